// Command schedule shows scheduled deliveries with Ladder in Go, in place of the
// rabbitmq-delayed-message-exchange plugin.
//
//	schedule [-queue orders] [-exchange ladder.default]
//
// It publishes s1, s2 and s3 to the ladder's exchange with x-delay 300, 600 and 900 ms and
// retry-to = the queue (publisher confirms, mandatory), then consumes the queue. Each delivery
// prints one line on stdout, `<message_id> waited_ms=<ms since it was published>`; it exits 0
// once all three came, 1 if they did not within 10 s. AMQP_URL names the broker (default
// amqp://guest:guest@127.0.0.1:5672/%2f). The ladder needs exact_delays = true (the default).
//
// Needs github.com/rabbitmq/amqp091-go v1.4.0 or newer (PublishWithContext); tested with
// Debian's 1.5.0. Builds like ../go (see ../README.md).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

var delays = []struct {
	id string
	ms int64
}{{"s1", 300}, {"s2", 600}, {"s3", 900}} // message_id and x-delay

// timeout bounds the wait for all three deliveries.
const timeout = 10 * time.Second

// README:schedule:start
// Plugin: ExchangeDeclare(X, "x-delayed-message", ..., amqp.Table{"x-delayed-type": "direct"}),
// QueueBind(queue, key, X, ...), publish to X. Ladder: nothing to declare or bind; publish to
// the ladder's exchange <namespace>.<ladder> and name the queue in retry-to.
// ch is in confirm mode (ch.Confirm(false)) with confirms from ch.NotifyPublish and returns from
// ch.NotifyReturn; this returns once the ladder holds the message, or an error if the broker
// nacked or returned it (mandatory: the plugin could not do that). One publish is in flight at
// a time, so the next confirm is this one's, and so is a return: it comes before the confirm.
func publishScheduled(ch *amqp.Channel, confirms <-chan amqp.Confirmation, returns <-chan amqp.Return,
	ladder, queue, messageID string, delayMs int64, body []byte) error {
	headers := amqp.Table{
		"x-delay":  delayMs, // as with the plugin: ms from now (or "delay-until": epoch ms)
		"retry-to": queue,   // new: the queue to deliver to (or "retry-to-exchange": an exchange)
	} // (int64: amqp091-go sends an int as 32 bits, too short for delays past 24.8 days)
	err := ch.PublishWithContext(context.Background(), ladder, "", true, false, amqp.Publishing{
		MessageId: messageID, Headers: headers, DeliveryMode: amqp.Persistent, Body: body,
	})
	if err != nil {
		return err
	}
	if confirm, open := <-confirms; !open {
		return amqp.ErrClosed
	} else if !confirm.Ack {
		return errors.New("the broker nacked it")
	}
	select {
	case r := <-returns:
		return fmt.Errorf("returned by the broker: %d %s", r.ReplyCode, r.ReplyText)
	default:
		return nil
	}
}

// README:schedule:end

func main() {
	log.SetPrefix("schedule: ")
	queue := flag.String("queue", "orders", "the queue to deliver to and consume")
	ladder := flag.String("exchange", "ladder.default", "the ladder's exchange, <namespace>.<ladder>")
	flag.Parse()
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
	// your own queue, as before; Ladder delivers to it through the default exchange
	_, err = ch.QueueDeclare(*queue, true, false, false, false, amqp.Table{"x-queue-type": "quorum"})
	if err != nil {
		log.Fatalf("declare %s: %v", *queue, err)
	}
	if err := ch.Confirm(false); err != nil {
		log.Fatalf("confirm mode: %v", err)
	}
	confirms := ch.NotifyPublish(make(chan amqp.Confirmation, 1))
	returns := ch.NotifyReturn(make(chan amqp.Return, 1))

	sent := map[string]time.Time{}
	for _, d := range delays {
		sent[d.id] = time.Now()
		err := publishScheduled(ch, confirms, returns, *ladder, *queue, d.id, d.ms, []byte("hello"))
		if err != nil {
			log.Fatalf("publish %s: %v", d.id, err)
		}
	}

	deliveries, err := ch.Consume(*queue, "", false, false, false, false, nil)
	if err != nil {
		log.Fatalf("consume %s: %v", *queue, err)
	}
	waiting, seen := len(delays), map[string]bool{}
	deadline := time.After(timeout)
	for waiting > 0 {
		select {
		case d, open := <-deliveries:
			if !open {
				log.Fatalf("the channel closed")
			}
			fmt.Printf("%s waited_ms=%d\n", d.MessageId, time.Since(sent[d.MessageId]).Milliseconds())
			if err := d.Ack(false); err != nil {
				log.Fatalf("ack: %v", err)
			}
			if !seen[d.MessageId] {
				seen[d.MessageId] = true
				waiting--
			}
		case <-deadline:
			log.Fatalf("%d deliveries missing after %v", waiting, timeout)
		}
	}
}
