// A complete Ladder consumer in Java (the RabbitMQ Java client com.rabbitmq:amqp-client 5.0.0 or
// newer, Java 11 or newer).
//
//   java -cp amqp-client.jar:slf4j-api.jar LadderConsumer.java explicit|dead-letter
//       [--queue orders] [--exchange ladder.default] [--prefetch 10] [--fail-always]
//
// explicit: on failure, publish the message to the ladder's exchange with retry-to = the queue
// (publisher confirms, mandatory), then ack the original; nack it with requeue if the publish is
// not confirmed. dead-letter: declare the queue with x-dead-letter-exchange = the ladder's
// exchange, and reject a failed message with requeue=false.
//
// AMQP_URL names the broker (default amqp://guest:guest@127.0.0.1:5672/%2f). Each delivery
// prints one line on stdout, `<message_id> attempt=<retry-attempt or 0>`; logs go to stderr.

import com.rabbitmq.client.AMQP;
import com.rabbitmq.client.Channel;
import com.rabbitmq.client.Connection;
import com.rabbitmq.client.ConnectionFactory;
import com.rabbitmq.client.Delivery;
import java.io.IOException;
import java.util.HashMap;
import java.util.Map;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.atomic.AtomicReference;

public final class LadderConsumer {
    static String queue = "orders"; // the queue this service consumes
    static String ladder = "ladder.default"; // the ladder's exchange: <namespace>.<ladder>
    static int prefetch = 10; // unacked deliveries at most
    static boolean failAlways = false; // --fail-always: handle fails every message

    /** The service's own work. Fails every message with --fail-always. */
    static void handle(byte[] body) throws Exception {
        if (failAlways) {
            throw new Exception("simulated failure (--fail-always)");
        }
    }

    /** The retry-attempt header (any integer type), 0 on the first delivery. */
    static long attempt(Delivery d) {
        Map<String, Object> headers = d.getProperties().getHeaders();
        Object attempt = headers == null ? null : headers.get("retry-attempt");
        return attempt instanceof Number ? ((Number) attempt).longValue() : 0;
    }

    // README:explicit:start
    // Explicit mode: on failure, publish the message to the ladder with retry-to = our queue.
    static void consumeExplicit(Channel ch) throws IOException {
        ch.queueDeclare(queue, true, false, false, Map.of("x-queue-type", "quorum"));
        ch.confirmSelect(); // publisher confirms for the retries
        AtomicReference<String> returned = new AtomicReference<>(); // mandatory publishes no queue took
        ch.addReturnListener(r -> returned.set(r.getReplyCode() + " " + r.getReplyText()));
        ch.basicQos(prefetch);
        ch.basicConsume(queue, false, (tag, d) -> {
            long attempt = attempt(d); // 0 = first delivery
            System.out.println(d.getProperties().getMessageId() + " attempt=" + attempt);
            try {
                handle(d.getBody());
            } catch (Exception failure) {
                System.err.println(queue + ": attempt " + attempt + " failed: " + failure.getMessage());
                String refused = retry(ch, returned, d, failure);
                if (refused != null) {
                    System.err.println(queue + ": retry not confirmed, requeueing: " + refused);
                    ch.basicNack(d.getEnvelope().getDeliveryTag(), false, true); // keep it
                    return;
                }
            }
            ch.basicAck(d.getEnvelope().getDeliveryTag(), false); // after a failure: once the retry is confirmed
        }, tag -> System.exit(1)); // cancelled by the broker: the queue was deleted
    }

    // Publishes d to the ladder and waits for the broker's confirm; null once confirmed, else why
    // not. Deliveries of a channel are handled one at a time and the broker sends a return before
    // its confirm, so a return is this publish's.
    static String retry(Channel ch, AtomicReference<String> returned, Delivery d, Exception cause) throws IOException {
        AMQP.BasicProperties p = d.getProperties();
        Map<String, Object> headers = new HashMap<>(); // a copy: retry-attempt etc. travel along
        if (p.getHeaders() != null) {
            headers.putAll(p.getHeaders());
        }
        headers.put("retry-to", queue);
        headers.put("retry-reason", String.valueOf(cause.getMessage()));
        AMQP.BasicProperties props = p.builder() // as received, less expiration and userId, persistent
            .expiration(null).userId(null).deliveryMode(2).headers(headers).build();
        returned.set(null);
        ch.basicPublish(ladder, "", true, props, d.getBody());
        try {
            if (!ch.waitForConfirms()) {
                return "nacked by the broker";
            }
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            return "interrupted";
        }
        return returned.get() == null ? null : "returned by the broker: " + returned.get();
    }
    // README:explicit:end

    // README:dead-letter:start
    // Dead-letter mode: the queue dead-letters into the ladder; on failure, reject the message.
    static void consumeDeadLetter(Channel ch) throws IOException {
        ch.queueDeclare(queue, true, false, false, Map.of(
            "x-queue-type", "quorum",
            "x-dead-letter-exchange", ladder));
        ch.basicQos(prefetch);
        ch.basicConsume(queue, false, (tag, d) -> {
            long attempt = attempt(d); // 0 = first delivery
            System.out.println(d.getProperties().getMessageId() + " attempt=" + attempt);
            try {
                handle(d.getBody());
            } catch (Exception failure) {
                System.err.println(queue + ": attempt " + attempt + " failed: " + failure.getMessage());
                ch.basicReject(d.getEnvelope().getDeliveryTag(), false); // requeue=false: dead-letters it to the ladder
                return;
            }
            ch.basicAck(d.getEnvelope().getDeliveryTag(), false);
        }, tag -> System.exit(1)); // cancelled by the broker: the queue was deleted
    }
    // README:dead-letter:end

    static void usage() {
        System.err.println("usage: LadderConsumer explicit|dead-letter [--queue Q] [--exchange X] [--prefetch N] [--fail-always]");
        System.exit(64);
    }

    public static void main(String[] args) throws Exception {
        if (args.length < 1 || !(args[0].equals("explicit") || args[0].equals("dead-letter"))) {
            usage();
        }
        String mode = args[0];
        for (int i = 1; i < args.length; i++) {
            switch (args[i]) {
                case "--queue": if (++i < args.length) { queue = args[i]; } else { usage(); } break;
                case "--exchange": if (++i < args.length) { ladder = args[i]; } else { usage(); } break;
                case "--prefetch": if (++i < args.length) { prefetch = Integer.parseInt(args[i]); } else { usage(); } break;
                case "--fail-always": failAlways = true; break;
                default: usage();
            }
        }
        String url = System.getenv().getOrDefault("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f");
        ConnectionFactory factory = new ConnectionFactory();
        factory.setUri(url);
        factory.setAutomaticRecoveryEnabled(false); // exit on a lost connection; a supervisor restarts us
        Connection conn = factory.newConnection("ladder-consumer-example");
        CountDownLatch closed = new CountDownLatch(1);
        conn.addShutdownListener(cause -> {
            System.err.println("consumer: connection closed: " + cause.getMessage());
            closed.countDown();
        });
        Channel ch = conn.createChannel();
        ch.addShutdownListener(cause -> {
            if (!cause.isHardError()) {
                System.err.println("consumer: channel closed: " + cause.getMessage());
                closed.countDown();
            }
        });
        System.err.println("consumer: " + mode + " mode: consuming " + queue + ", failures go to " + ladder);
        if (mode.equals("explicit")) {
            consumeExplicit(ch);
        } else {
            consumeDeadLetter(ch);
        }
        closed.await();
        System.exit(1);
    }
}
