#!/usr/bin/env node
// A complete Ladder consumer in Node.js (amqplib 0.10 or newer, Node.js 14 or newer).
//
//   node consumer.js explicit|dead-letter [--queue orders] [--exchange ladder.default]
//                                         [--prefetch 10] [--fail-always]
//
// explicit: on failure, publish the message to the ladder's exchange with retry-to = the queue
// (publisher confirms, mandatory), then ack the original; nack it with requeue if the publish is
// not confirmed. dead-letter: declare the queue with x-dead-letter-exchange = the ladder's
// exchange, and reject a failed message with requeue=false.
//
// AMQP_URL names the broker (default amqp://guest:guest@127.0.0.1:5672/%2f). Each delivery
// prints one line on stdout, `<message_id> attempt=<retry-attempt or 0>`; logs go to stderr.
'use strict';
const amqp = require('amqplib');

let QUEUE = 'orders'; // the queue this service consumes
let LADDER = 'ladder.default'; // the ladder's exchange: <namespace>.<ladder>
let PREFETCH = 10; // unacked deliveries at most
let FAIL_ALWAYS = false; // --fail-always: handle fails every message

// The service's own work. Fails every message with --fail-always.
async function handle(content) {
  if (FAIL_ALWAYS) throw new Error('simulated failure (--fail-always)');
}

// README:explicit:start
// Explicit mode: on failure, publish the message to the ladder with retry-to = our queue.
// ch is a confirm channel: await conn.createConfirmChannel()
async function consumeExplicit(ch) {
  await ch.assertQueue(QUEUE, { durable: true, arguments: { 'x-queue-type': 'quorum' } });
  await ch.prefetch(PREFETCH);
  await ch.consume(QUEUE, async (msg) => {
    if (msg === null) process.exit(1); // cancelled by the broker: the queue was deleted
    const p = msg.properties;
    const attempt = p.headers?.['retry-attempt'] ?? 0; // 0 = first delivery
    console.log(`${p.messageId} attempt=${attempt}`);
    try {
      await handle(msg.content);
    } catch (err) {
      console.warn(`${QUEUE}: attempt ${attempt} failed: ${err.message}`);
      try {
        await retry(ch, msg, err);
      } catch (e) {
        console.warn(`${QUEUE}: retry not confirmed, requeueing: ${e.message}`);
        ch.nack(msg, false, true); // keep it
        return;
      }
    }
    ch.ack(msg); // after a failure: only once the retry is confirmed
  });
}

// Publishes msg to the ladder and resolves once the broker confirmed it. One retry is in flight
// at a time and the broker sends a return before its confirm, so a return is this publish's.
let previous = Promise.resolve();
function retry(ch, msg, err) {
  const p = msg.properties;
  const headers = { ...p.headers, 'retry-to': QUEUE, // a copy: retry-attempt etc. travel along
    'retry-reason': String(err.message).slice(0, 200) };
  const options = { headers, persistent: true, mandatory: true, // less expiration and userId
    contentType: p.contentType, contentEncoding: p.contentEncoding, correlationId: p.correlationId,
    messageId: p.messageId, replyTo: p.replyTo, priority: p.priority, timestamp: p.timestamp,
    type: p.type, appId: p.appId };
  const publish = () => new Promise((resolve, reject) => {
    let returned = null;
    const onReturn = (r) => { returned = r; };
    ch.on('return', onReturn);
    ch.publish(LADDER, '', msg.content, options, (e) => { // called on the broker's ack or nack
      ch.removeListener('return', onReturn);
      if (e) reject(e);
      else if (returned) reject(new Error(`returned by the broker: ${returned.fields.replyText}`));
      else resolve();
    });
  });
  const confirmed = previous.then(publish);
  previous = confirmed.catch(() => {});
  return confirmed;
}
// README:explicit:end

// README:dead-letter:start
// Dead-letter mode: the queue dead-letters into the ladder; on failure, reject the message.
async function consumeDeadLetter(ch) {
  await ch.assertQueue(QUEUE, { durable: true, arguments: {
    'x-queue-type': 'quorum',
    'x-dead-letter-exchange': LADDER,
  } });
  await ch.prefetch(PREFETCH);
  await ch.consume(QUEUE, async (msg) => {
    if (msg === null) process.exit(1); // cancelled by the broker: the queue was deleted
    const attempt = msg.properties.headers?.['retry-attempt'] ?? 0; // 0 = first delivery
    console.log(`${msg.properties.messageId} attempt=${attempt}`);
    try {
      await handle(msg.content);
    } catch (err) {
      console.warn(`${QUEUE}: attempt ${attempt} failed: ${err.message}`);
      ch.reject(msg, false); // requeue=false: dead-letters it to the ladder
      return;
    }
    ch.ack(msg);
  });
}
// README:dead-letter:end

function usage() {
  console.error('usage: node consumer.js explicit|dead-letter [--queue Q] [--exchange X] [--prefetch N] [--fail-always]');
  process.exit(64);
}

async function main() {
  const [mode, ...args] = process.argv.slice(2);
  if (mode !== 'explicit' && mode !== 'dead-letter') usage();
  for (let i = 0; i < args.length; i++) {
    const value = () => args[++i] ?? usage();
    if (args[i] === '--queue') QUEUE = value();
    else if (args[i] === '--exchange') LADDER = value();
    else if (args[i] === '--prefetch') PREFETCH = Number(value());
    else if (args[i] === '--fail-always') FAIL_ALWAYS = true;
    else usage();
  }
  const url = process.env.AMQP_URL || 'amqp://guest:guest@127.0.0.1:5672/%2f';
  const conn = await amqp.connect(url);
  conn.on('error', (err) => console.error(`consumer: connection error: ${err.message}`));
  conn.on('close', () => { console.error('consumer: connection closed'); process.exit(1); });
  process.on('SIGINT', () => conn.close().finally(() => process.exit(0)));
  // explicit mode publishes the retries, with confirms, on the channel it consumes from
  const ch = mode === 'explicit' ? await conn.createConfirmChannel() : await conn.createChannel();
  ch.on('error', (err) => console.error(`consumer: channel error: ${err.message}`));
  ch.on('close', () => { console.error('consumer: channel closed'); process.exit(1); });
  console.error(`consumer: ${mode} mode: consuming ${QUEUE}, failures go to ${LADDER}`);
  await (mode === 'explicit' ? consumeExplicit(ch) : consumeDeadLetter(ch));
}

main().catch((err) => { console.error(`consumer: ${err.message}`); process.exit(1); });
