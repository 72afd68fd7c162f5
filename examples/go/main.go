// Command consumer is a complete Ladder consumer in Go: it consumes a queue and hands every
// message it fails on to a ladder, in one of the two modes Ladder supports.
//
//	consumer explicit|dead-letter [-queue orders] [-exchange ladder.default] [-prefetch 10] [-fail-always]
//
// explicit: on failure, publish the message to the ladder's exchange with retry-to = the queue
// (publisher confirms, mandatory), then ack the original; nack it with requeue if the publish
// is not confirmed. dead-letter: declare the queue with x-dead-letter-exchange = the ladder's
// exchange, and reject a failed message with requeue=false.
//
// AMQP_URL names the broker (default amqp://guest:guest@127.0.0.1:5672/%2f). Each delivery
// prints one line on stdout, `<message_id> attempt=<retry-attempt or 0>`; logs go to stderr.
//
// Needs github.com/rabbitmq/amqp091-go v1.4.0 or newer (PublishWithContext); tested with
// Debian's 1.5.0. See ../README.md for how to build it offline.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"

	amqp "github.com/rabbitmq/amqp091-go"
)

var (
	queue      = "orders"         // the queue this service consumes
	ladder     = "ladder.default" // the ladder's exchange: <namespace>.<ladder>
	prefetch   = 10               // unacked deliveries at most
	failAlways = false            // -fail-always: handle fails every message
)

// handle is the service's own work. It fails every message with -fail-always.
func handle(body []byte) error {
	if failAlways {
		return errors.New("simulated failure (-fail-always)")
	}
	return nil
}

// README:explicit:start
// Explicit mode: on failure, publish the message to the ladder with retry-to = our queue.
func consumeExplicit(ch *amqp.Channel) error {
	_, err := ch.QueueDeclare(queue, true, false, false, false, amqp.Table{"x-queue-type": "quorum"})
	if err != nil {
		return err
	}
	if err := ch.Confirm(false); err != nil { // publisher confirms for the retries
		return err
	}
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, 1))
	returns := ch.NotifyReturn(make(chan amqp.Return, 1)) // mandatory publishes no queue took
	if err := ch.Qos(prefetch, 0, false); err != nil {
		return err
	}
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		return err
	}
	for d := range deliveries {
		attempt, _ := d.Headers["retry-attempt"].(int64) // 0 = first delivery
		fmt.Printf("%s attempt=%d\n", d.MessageId, attempt)
		if failure := handle(d.Body); failure != nil {
			log.Printf("%s: attempt %d failed: %v", queue, attempt, failure)
			if err := retry(ch, confirms, returns, d, failure); err != nil {
				log.Printf("%s: retry not confirmed, requeueing: %v", queue, err)
				if err := d.Nack(false, true); err != nil {
					return err
				}
				continue
			}
		}
		if err := d.Ack(false); err != nil { // after a failure: only once the retry is confirmed
			return err
		}
	}
	return amqp.ErrClosed // the channel or the connection closed
}

// retry publishes d to the ladder and waits for the broker's confirm. One retry is in flight
// at a time, so the next confirm is this publish's, and so is a return: the broker sends it
// before the confirm. (NotifyPublish, not a DeferredConfirmation: before amqp091-go 1.8, its
// Wait could miss a confirm that came fast, and hang.)
func retry(ch *amqp.Channel, confirms <-chan amqp.Confirmation, returns <-chan amqp.Return,
	d amqp.Delivery, cause error) error {
	headers := amqp.Table{} // a copy of the received headers: retry-attempt etc. travel along
	for k, v := range d.Headers {
		headers[k] = v
	}
	headers["retry-to"] = queue
	headers["retry-reason"] = cause.Error()
	err := ch.PublishWithContext(context.Background(), ladder, "", true, false,
		amqp.Publishing{ // as received, less Expiration and UserId, persistent
			Headers: headers, ContentType: d.ContentType, ContentEncoding: d.ContentEncoding,
			CorrelationId: d.CorrelationId, MessageId: d.MessageId, ReplyTo: d.ReplyTo,
			Priority: d.Priority, Timestamp: d.Timestamp, Type: d.Type, AppId: d.AppId,
			DeliveryMode: amqp.Persistent, Body: d.Body,
		})
	if err != nil {
		return err
	}
	if confirm, open := <-confirms; !open {
		return amqp.ErrClosed
	} else if !confirm.Ack {
		return errors.New("the broker nacked the retry")
	}
	select {
	case r := <-returns:
		return fmt.Errorf("returned by the broker: %d %s", r.ReplyCode, r.ReplyText)
	default:
		return nil
	}
}

// README:explicit:end

// README:dead-letter:start
// Dead-letter mode: the queue dead-letters into the ladder; on failure, reject the message.
func consumeDeadLetter(ch *amqp.Channel) error {
	_, err := ch.QueueDeclare(queue, true, false, false, false, amqp.Table{
		"x-queue-type":           "quorum",
		"x-dead-letter-exchange": ladder,
	})
	if err != nil {
		return err
	}
	if err := ch.Qos(prefetch, 0, false); err != nil {
		return err
	}
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		return err
	}
	for d := range deliveries {
		attempt, _ := d.Headers["retry-attempt"].(int64) // 0 = first delivery
		fmt.Printf("%s attempt=%d\n", d.MessageId, attempt)
		if failure := handle(d.Body); failure != nil {
			log.Printf("%s: attempt %d failed: %v", queue, attempt, failure)
			if err := d.Reject(false); err != nil { // requeue=false: dead-letters it to the ladder
				return err
			}
			continue
		}
		if err := d.Ack(false); err != nil {
			return err
		}
	}
	return amqp.ErrClosed // the channel or the connection closed
}

// README:dead-letter:end

func main() {
	log.SetPrefix("consumer: ")
	if len(os.Args) < 2 || (os.Args[1] != "explicit" && os.Args[1] != "dead-letter") {
		fmt.Fprintln(os.Stderr, "usage: consumer explicit|dead-letter [-queue Q] [-exchange X] [-prefetch N] [-fail-always]")
		os.Exit(64)
	}
	mode := os.Args[1]
	flags := flag.NewFlagSet(mode, flag.ExitOnError)
	flags.StringVar(&queue, "queue", queue, "the queue to consume (and to return failed messages to)")
	flags.StringVar(&ladder, "exchange", ladder, "the ladder's exchange, <namespace>.<ladder>")
	flags.IntVar(&prefetch, "prefetch", prefetch, "unacked deliveries at most")
	flags.BoolVar(&failAlways, "fail-always", failAlways, "fail every message")
	_ = flags.Parse(os.Args[2:]) // ExitOnError: exits on a bad flag

	url := os.Getenv("AMQP_URL")
	if url == "" {
		url = "amqp://guest:guest@127.0.0.1:5672/%2f"
	}
	conn, err := amqp.Dial(url)
	if err != nil {
		log.Fatalf("connect: %v", err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		log.Fatalf("channel: %v", err)
	}
	log.Printf("%s mode: consuming %s, failures go to %s", mode, queue, ladder)
	if mode == "explicit" {
		err = consumeExplicit(ch)
	} else {
		err = consumeDeadLetter(ch)
	}
	log.Fatalf("%s: %v", queue, err) // a supervisor restarts the consumer
}
