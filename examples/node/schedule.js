#!/usr/bin/env node
// Scheduled deliveries with Ladder in Node.js (amqplib 0.10 or newer, Node.js 14 or newer), in
// place of the rabbitmq-delayed-message-exchange plugin.
//
//   node schedule.js [--queue orders] [--exchange ladder.default]
//
// Publishes s1, s2 and s3 to the ladder's exchange with x-delay 300, 600 and 900 ms and
// retry-to = the queue (publisher confirms, mandatory), then consumes the queue. Each delivery
// prints one line on stdout, `<message_id> waited_ms=<ms since it was published>`; exits 0 once
// all three came, 1 if they did not within 10 s. AMQP_URL names the broker (default
// amqp://guest:guest@127.0.0.1:5672/%2f). The ladder needs exact_delays = true (the default).
'use strict';
const amqp = require('amqplib');
const { performance } = require('perf_hooks');

const DELAYS = { s1: 300, s2: 600, s3: 900 }; // message_id -> x-delay in ms
const TIMEOUT_MS = 10000; // to wait for all three deliveries

// README:schedule:start
// Plugin: assertExchange(X, 'x-delayed-message', { arguments: { 'x-delayed-type': 'direct' } }),
// bindQueue(queue, X, key), publish to X. Ladder: nothing to declare or bind; publish to the
// ladder's exchange <namespace>.<ladder> and name the queue in retry-to.
// ch is a confirm channel (await conn.createConfirmChannel()); resolves once the ladder holds
// the message, rejects if the broker nacked or returned it (mandatory: the plugin could not).
function publishScheduled(ch, ladder, queue, messageId, delayMs, body) {
  const headers = {
    'x-delay': delayMs, // as with the plugin: ms from now (or 'delay-until': epoch ms)
    'retry-to': queue, // new: the queue to deliver to (or 'retry-to-exchange': an exchange)
  };
  return new Promise((resolve, reject) => {
    let returned = null;
    const onReturn = (r) => { if (r.properties.messageId === messageId) returned = r; };
    ch.on('return', onReturn); // the broker sends a return before its confirm
    ch.publish(ladder, '', body, { messageId, headers, persistent: true, mandatory: true }, (err) => {
      ch.removeListener('return', onReturn);
      if (err) reject(err);
      else if (returned) reject(new Error(`returned: ${returned.fields.replyText}`));
      else resolve();
    });
  });
}
// README:schedule:end

function arg(name, fallback) {
  const i = process.argv.indexOf(name);
  return i > 0 && i + 1 < process.argv.length ? process.argv[i + 1] : fallback;
}

async function main() {
  const queue = arg('--queue', 'orders');
  const ladder = arg('--exchange', 'ladder.default');
  const conn = await amqp.connect(process.env.AMQP_URL || 'amqp://guest:guest@127.0.0.1:5672/%2f');
  const ch = await conn.createConfirmChannel();
  // your own queue, as before; Ladder delivers to it through the default exchange
  await ch.assertQueue(queue, { durable: true, arguments: { 'x-queue-type': 'quorum' } });

  const sent = {};
  await Promise.all(Object.entries(DELAYS).map(([id, delayMs]) => {
    sent[id] = performance.now();
    return publishScheduled(ch, ladder, queue, id, delayMs, Buffer.from('hello'));
  }));

  const waiting = new Set(Object.keys(DELAYS));
  const timer = setTimeout(() => {
    console.error(`schedule: ${[...waiting]} not delivered within ${TIMEOUT_MS} ms`);
    process.exit(1);
  }, TIMEOUT_MS);
  await ch.consume(queue, (msg) => {
    if (msg === null) process.exit(1); // cancelled by the broker: the queue was deleted
    const id = msg.properties.messageId;
    console.log(`${id} waited_ms=${Math.floor(performance.now() - sent[id])}`);
    ch.ack(msg);
    waiting.delete(id);
    if (waiting.size === 0) {
      clearTimeout(timer);
      conn.close().then(() => process.exit(0));
    }
  });
}

main().catch((err) => {
  console.error(`schedule: ${err.message}`);
  process.exit(1);
});
