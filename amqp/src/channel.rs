//! Channels: calls (declare, bind, consume …), consumers, publishing with confirms, acks.
//!
//! ## Returns are matched to the publish they belong to
//!
//! A `basic.return` carries no delivery tag. RabbitMQ sends it before the ack that confirms the
//! same publish, but one ack may confirm many publishes (`multiple`), and returns of publishes
//! confirmed by a later ack may already have arrived. So a return is matched here by what it
//! carries: among the publishes not yet confirmed and not yet matched, the oldest one with the
//! same exchange and routing key and the same body, `message_id` and `correlation_id`
//! (`Fingerprint`). When an ack then confirms a publish, the publish is `Returned` if a return
//! was matched to it, else `Ack` — whatever order the acks of a `multiple` are processed in.
//! Two publishes that are alike in all of these are interchangeable: one of them was returned,
//! and either answer describes the same message.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use bytes::{BufMut, BytesMut};
use tokio::sync::{mpsc, oneshot};
use tracing::warn;

use crate::error::{CloseReason, Error, Result};
use crate::frame::{self, FRAME_OVERHEAD, Frame};
use crate::io::{Endpoint, Io, Link, content_header, put_content_header};
use crate::method::{Close, Method, put_publish};
use crate::properties::{BasicProperties, WireProperties};
use crate::types::{Carried, DecodeError, FieldTable, Reader, ShortString};

/// A delivery from a consumer.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// The tag to ack it with, on the channel it came on.
    pub delivery_tag: u64,
    /// The broker delivered it before.
    pub redelivered: bool,
    /// The exchange it was published to.
    pub exchange: ShortString,
    /// The routing key it was published with.
    pub routing_key: ShortString,
    /// Its properties; default when they did not decode (see `undecodable`).
    pub properties: BasicProperties,
    /// The property bytes as received, when they did not decode. Boxed: it is rare, and a
    /// delivery is held by every future that handles one.
    pub undecodable: Option<Box<Undecodable>>,
    /// The body.
    pub body: Vec<u8>,
}

/// Properties the decoder could not read, kept as bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Undecodable {
    /// The property flags and list exactly as received.
    pub bytes: Vec<u8>,
    /// Why they did not decode.
    pub error: DecodeError,
    /// What they say with every table or array nested too deep replaced by `Void`, if even
    /// that decodes: enough to read the shallow headers, never to republish.
    pub lossy: Option<BasicProperties>,
}

/// What the broker said about one publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Confirmation {
    /// Taken: routed to every queue the exchange picked (none, for a non-mandatory publish).
    Ack,
    /// Refused (the queue could not take it); publish again.
    Nack,
    /// A mandatory publish no queue took; the broker returned it, then acked it.
    Returned(Returned),
    /// The channel is not in confirm mode; nothing is known.
    NotRequested,
}

/// The broker's reasons for a return.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Returned {
    /// 312 NO_ROUTE, 313 NO_CONSUMERS.
    pub reply_code: u16,
    /// The broker's text.
    pub reply_text: String,
    /// As published.
    pub exchange: ShortString,
    /// As published.
    pub routing_key: ShortString,
}

/// Resolves when the broker confirmed (or refused, or returned) one publish.
#[derive(Debug)]
pub struct PublishConfirm(ConfirmState);

#[derive(Debug)]
enum ConfirmState {
    Ready(Option<Confirmation>),
    Waiting(oneshot::Receiver<Result<Confirmation>>),
}

impl Future for PublishConfirm {
    type Output = Result<Confirmation>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.0 {
            ConfirmState::Ready(c) => Poll::Ready(c.take().ok_or(Error::ChannelGone)),
            ConfirmState::Waiting(rx) => Pin::new(rx).poll(cx).map(|r| r.unwrap_or(Err(Error::ChannelGone))),
        }
    }
}

/// A consumer's deliveries, in order. Ends (`None`) when the consumer is cancelled, by this side
/// or by the broker (its queue was deleted); yields the error when the channel fails.
#[derive(Debug)]
pub struct Consumer {
    tag: ShortString,
    rx: mpsc::UnboundedReceiver<Result<Delivery>>,
}

impl Consumer {
    /// The consumer tag.
    pub fn tag(&self) -> &ShortString {
        &self.tag
    }

    /// The next delivery.
    pub async fn next(&mut self) -> Option<Result<Delivery>> {
        self.rx.recv().await
    }
}

impl futures_core::Stream for Consumer {
    type Item = Result<Delivery>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}

/// Options of `queue.declare`.
#[derive(Debug, Clone, Copy, Default)]
pub struct QueueOptions {
    /// Only check that it exists (404 closes the channel if not).
    pub passive: bool,
    /// Survives a broker restart.
    pub durable: bool,
    /// Owned by this connection, deleted with it.
    pub exclusive: bool,
    /// Deleted when its last consumer goes.
    pub auto_delete: bool,
}

/// What `queue.declare` answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueInfo {
    /// The name (the broker's choice for an empty name).
    pub name: ShortString,
    /// Ready messages.
    pub message_count: u32,
    /// Consumers.
    pub consumer_count: u32,
}

/// A channel. Cheap to clone; the last clone dropped closes it.
#[derive(Clone)]
pub struct Channel {
    handle: Arc<ChannelHandle>,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel").field("id", &self.handle.shared.id).finish()
    }
}

struct ChannelHandle {
    _link: Arc<Link>,
    shared: Arc<ChannelShared>,
}

impl Drop for ChannelHandle {
    fn drop(&mut self) {
        // close what is still open, without waiting; the reader frees the id at close-ok
        let shared = &self.shared;
        let open = {
            let mut st = shared.lock();
            let open = st.error.is_none() && !st.closing;
            st.closing = true;
            open
        };
        if open {
            let close = Method::ChannelClose(Close {
                reply_code: 200,
                reply_text: ShortString::default(),
                class_id: 0,
                method_id: 0,
            });
            if shared.io.send_method(shared.id, &close).is_err() {
                shared.io.remove_channel(shared.id);
            }
        }
    }
}

/// One channel's state, shared by its handles and the connection's reader.
pub(crate) struct ChannelShared {
    pub(crate) id: u16,
    pub(crate) io: Arc<Io>,
    state: Mutex<ChannelState>,
    calls: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct ChannelState {
    error: Option<Error>,
    closing: bool,
    call: Option<Call>,
    consumers: HashMap<ShortString, mpsc::UnboundedSender<Result<Delivery>>>,
    confirms: Option<Confirms>,
    incoming: Option<Incoming>,
    /// Headers left out of the deliveries' properties (see [`Channel::skip_header_keys`]).
    skipped_headers: &'static [&'static str],
    /// Deliveries whose routing key begins with this keep them (see
    /// [`Channel::skip_header_keys_unless_routed`]).
    keep_headers_routed: Option<&'static str>,
}

struct Call {
    reply: (u16, u16),
    alt_reply: Option<(u16, u16)>,
    tx: oneshot::Sender<Result<Method>>,
    consumer: Option<mpsc::UnboundedSender<Result<Delivery>>>,
}

#[derive(Default)]
struct Confirms {
    next_tag: u64,
    pending: BTreeMap<u64, Pending>,
}

struct Pending {
    fingerprint: Fingerprint,
    returned: Option<Returned>,
    tx: oneshot::Sender<Result<Confirmation>>,
}

/// What identifies a publish when it comes back in a `basic.return`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fingerprint {
    route: u64,
    content: u64,
}

impl Fingerprint {
    fn new(exchange: &[u8], routing_key: &[u8], properties: &BasicProperties, body: &[u8]) -> Self {
        let mut route = std::collections::hash_map::DefaultHasher::new();
        exchange.hash(&mut route);
        routing_key.hash(&mut route);
        let mut content = std::collections::hash_map::DefaultHasher::new();
        body.hash(&mut content);
        properties
            .message_id
            .as_ref()
            .map(ShortString::as_bytes)
            .hash(&mut content);
        properties
            .correlation_id
            .as_ref()
            .map(ShortString::as_bytes)
            .hash(&mut content);
        Fingerprint {
            route: route.finish(),
            content: content.finish(),
        }
    }
}

enum IncomingKind {
    Deliver {
        consumer_tag: ShortString,
        delivery_tag: u64,
        redelivered: bool,
        exchange: ShortString,
        routing_key: ShortString,
    },
    Return(Returned),
    GetOk,
}

struct Incoming {
    kind: IncomingKind,
    size: u64,
    properties: Option<WireProperties>,
    body: Vec<u8>,
}

impl Incoming {
    /// A message whose method frame came, its header and body frames still to come.
    fn new(kind: IncomingKind) -> Self {
        Incoming {
            kind,
            size: 0,
            properties: None,
            body: Vec::new(),
        }
    }
}

/// The initial capacity for a body is at most this; a larger body grows as its frames arrive.
const BODY_PREALLOCATE_MAX: u64 = 1 << 20;

impl ChannelShared {
    pub(crate) fn new(id: u16, io: Arc<Io>) -> Self {
        ChannelShared {
            id,
            io,
            state: Mutex::new(ChannelState::default()),
            calls: tokio::sync::Mutex::new(()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, ChannelState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Fails everything waiting on the channel with `error`.
    pub(crate) fn fail(&self, error: Error) {
        let mut st = self.lock();
        if st.error.is_some() {
            return;
        }
        st.error = Some(error.clone());
        if let Some(call) = st.call.take() {
            let _ = call.tx.send(Err(error.clone()));
        }
        for (_, tx) in st.consumers.drain() {
            let _ = tx.send(Err(error.clone()));
        }
        if let Some(confirms) = st.confirms.take() {
            for (_, p) in confirms.pending {
                let _ = p.tx.send(Err(error.clone()));
            }
        }
        st.incoming = None;
    }

    /// Handles one frame for this channel (the connection's reader calls it).
    pub(crate) fn receive(&self, frame: Frame) -> Result<()> {
        match frame.kind {
            frame::METHOD => {
                let method = Method::decode(&frame.payload).map_err(|e| Error::Protocol(e.to_string()))?;
                self.on_method(method)
            }
            frame::HEADER => {
                let (size, props) = content_header(&frame.payload)?;
                let complete = {
                    let mut st = self.lock();
                    let (skipped, keep) = (st.skipped_headers, st.keep_headers_routed);
                    let Some(incoming) = st.incoming.as_mut() else {
                        return if st.closing || st.error.is_some() {
                            Ok(())
                        } else {
                            Err(Error::Protocol("content header without a method".into()))
                        };
                    };
                    incoming.size = size;
                    incoming.body = Vec::with_capacity(size.min(BODY_PREALLOCATE_MAX) as usize);
                    let kept = match (&incoming.kind, keep) {
                        (IncomingKind::Deliver { routing_key, .. }, Some(prefix)) => {
                            routing_key.as_bytes().starts_with(prefix.as_bytes())
                        }
                        _ => false,
                    };
                    let mut r = Reader::new(props).skipping(if kept { &[] } else { skipped });
                    incoming.properties = Some(match BasicProperties::decode(&mut r) {
                        Ok(p) => WireProperties::Decoded(Box::new(p)),
                        Err(error) => WireProperties::Raw {
                            bytes: props.to_vec(),
                            error,
                        },
                    });
                    size == 0
                };
                if complete { self.complete() } else { Ok(()) }
            }
            frame::BODY => {
                let complete = {
                    let mut st = self.lock();
                    let Some(incoming) = st.incoming.as_mut().filter(|i| i.properties.is_some()) else {
                        return if st.closing || st.error.is_some() {
                            Ok(())
                        } else {
                            Err(Error::Protocol("content body without a header".into()))
                        };
                    };
                    incoming.body.extend_from_slice(&frame.payload);
                    if incoming.body.len() as u64 > incoming.size {
                        return Err(Error::Protocol("content body longer than announced".into()));
                    }
                    incoming.body.len() as u64 == incoming.size
                };
                if complete { self.complete() } else { Ok(()) }
            }
            other => Err(Error::Protocol(format!("frame type {other} on a channel"))),
        }
    }

    fn complete(&self) -> Result<()> {
        let mut st = self.lock();
        let Some(incoming) = st.incoming.take() else {
            return Ok(());
        };
        let (properties, undecodable) = match incoming.properties {
            Some(WireProperties::Decoded(p)) => (*p, None),
            Some(WireProperties::Raw { bytes, error }) => {
                let lossy = BasicProperties::decode(&mut Reader::lossy(&bytes)).ok();
                (
                    BasicProperties::default(),
                    Some(Box::new(Undecodable { bytes, error, lossy })),
                )
            }
            None => (BasicProperties::default(), None),
        };
        match incoming.kind {
            IncomingKind::Deliver {
                consumer_tag,
                delivery_tag,
                redelivered,
                exchange,
                routing_key,
            } => {
                if let Some(tx) = st.consumers.get(&consumer_tag) {
                    let _ = tx.send(Ok(Delivery {
                        delivery_tag,
                        redelivered,
                        exchange,
                        routing_key,
                        properties,
                        undecodable,
                        body: incoming.body,
                    }));
                }
            }
            IncomingKind::Return(returned) => {
                let fingerprint = Fingerprint::new(
                    returned.exchange.as_bytes(),
                    returned.routing_key.as_bytes(),
                    &properties,
                    &incoming.body,
                );
                let Some(confirms) = st.confirms.as_mut() else {
                    warn!(routing_key = %returned.routing_key, "the broker returned a publish on a channel without confirms");
                    return Ok(());
                };
                let unmatched = |p: &&mut Pending| p.returned.is_none() && p.fingerprint.route == fingerprint.route;
                let mut candidates = confirms.pending.values_mut().filter(unmatched);
                let exact = candidates.find(|p| p.fingerprint.content == fingerprint.content);
                let chosen = match exact {
                    Some(p) => Some(p),
                    // properties may come back re-encoded; the route alone still names the publish
                    None => confirms
                        .pending
                        .values_mut()
                        .find(|p| p.returned.is_none() && p.fingerprint.route == fingerprint.route),
                };
                match chosen {
                    Some(p) => p.returned = Some(returned),
                    None => {
                        warn!(routing_key = %returned.routing_key, "a return matches no publish awaiting its confirm")
                    }
                }
            }
            IncomingKind::GetOk => {}
        }
        Ok(())
    }

    fn on_method(&self, method: Method) -> Result<()> {
        let id = method.id();
        let mut st = self.lock();
        match method {
            Method::BasicDeliver {
                consumer_tag,
                delivery_tag,
                redelivered,
                exchange,
                routing_key,
            } => {
                st.incoming = Some(Incoming::new(IncomingKind::Deliver {
                    consumer_tag,
                    delivery_tag,
                    redelivered,
                    exchange,
                    routing_key,
                }));
            }
            Method::BasicReturn {
                reply_code,
                reply_text,
                exchange,
                routing_key,
            } => {
                st.incoming = Some(Incoming::new(IncomingKind::Return(Returned {
                    reply_code,
                    reply_text: reply_text.to_string_lossy().into_owned(),
                    exchange,
                    routing_key,
                })));
            }
            Method::BasicGetOk { .. } => {
                st.incoming = Some(Incoming::new(IncomingKind::GetOk));
            }
            Method::BasicAck { delivery_tag, multiple } => settle(&mut st, delivery_tag, multiple, true),
            Method::BasicNack {
                delivery_tag, multiple, ..
            } => settle(&mut st, delivery_tag, multiple, false),
            Method::BasicCancel { consumer_tag, .. } => {
                // the broker cancelled the consumer (its queue is gone): end its stream
                st.consumers.remove(&consumer_tag);
            }
            Method::ChannelClose(close) => {
                drop(st);
                let _ = self.io.send_method(self.id, &Method::ChannelCloseOk);
                self.io.remove_channel(self.id);
                let closing_ourselves = self.lock().closing;
                let error = Error::ChannelClosed(CloseReason::from(&close));
                if closing_ourselves {
                    // both sides closed at once: our close is done too
                    if let Some(call) = self.lock().call.take() {
                        let _ = call.tx.send(Ok(Method::ChannelCloseOk));
                    }
                }
                self.fail(error);
            }
            Method::ChannelCloseOk => {
                if let Some(call) = st.call.take() {
                    let _ = call.tx.send(Ok(Method::ChannelCloseOk));
                }
                drop(st);
                self.io.remove_channel(self.id);
                self.fail(Error::ChannelGone);
            }
            Method::ChannelFlow { active } => {
                drop(st);
                self.io.send_method(self.id, &Method::ChannelFlowOk { active })?;
            }
            reply => return self.on_reply(st, id, reply),
        }
        Ok(())
    }

    /// The reply to the call waiting on this channel: checked against what the call awaits,
    /// and the consumer or confirm state it sets up recorded before the caller hears of it.
    fn on_reply(&self, mut st: MutexGuard<'_, ChannelState>, id: (u16, u16), reply: Method) -> Result<()> {
        let Some(call) = st.call.take() else {
            return if st.closing {
                Ok(())
            } else {
                Err(Error::Protocol(format!("unexpected method {}.{}", id.0, id.1)))
            };
        };
        if call.reply != id && call.alt_reply != Some(id) {
            return Err(Error::Protocol(format!(
                "expected method {}.{}, the broker sent {}.{}",
                call.reply.0, call.reply.1, id.0, id.1
            )));
        }
        match &reply {
            Method::BasicConsumeOk { consumer_tag } => {
                if let Some(tx) = call.consumer {
                    st.consumers.insert(consumer_tag.clone(), tx);
                }
            }
            Method::BasicCancelOk { consumer_tag } => {
                st.consumers.remove(consumer_tag);
            }
            Method::ConfirmSelectOk => {
                st.confirms.get_or_insert_with(|| Confirms {
                    next_tag: 1,
                    pending: BTreeMap::new(),
                });
            }
            _ => {}
        }
        let _ = call.tx.send(Ok(reply));
        Ok(())
    }
}

impl Endpoint for ChannelShared {
    fn receive(&self, frame: Frame) -> Result<()> {
        ChannelShared::receive(self, frame)
    }

    fn fail(&self, error: Error) {
        ChannelShared::fail(self, error)
    }
}

fn settle(st: &mut ChannelState, tag: u64, multiple: bool, ack: bool) {
    let Some(confirms) = st.confirms.as_mut() else {
        return;
    };
    let settled: Vec<Pending> = if multiple {
        let rest = confirms.pending.split_off(&(tag.saturating_add(1)));
        std::mem::replace(&mut confirms.pending, rest).into_values().collect()
    } else {
        confirms.pending.remove(&tag).into_iter().collect()
    };
    for p in settled {
        let confirmation = match (ack, p.returned) {
            (true, Some(returned)) => Confirmation::Returned(returned),
            (true, None) => Confirmation::Ack,
            (false, _) => Confirmation::Nack,
        };
        let _ = p.tx.send(Ok(confirmation));
    }
}

/// The reply a call waits for.
fn reply_to(method: &Method) -> ((u16, u16), Option<(u16, u16)>) {
    let (class, id) = method.id();
    match method {
        Method::BasicGet { .. } => ((60, 71), Some((60, 72))),
        // the one reply whose id is not the request's plus one (AMQP 0-9-1 as RabbitMQ has it)
        Method::ExchangeUnbind { .. } => ((40, 51), None),
        _ => ((class, id + 1), None),
    }
}

/// Closes the channel if a call is abandoned (its future dropped, e.g. by a timeout) before the
/// reply came: a late reply must not answer the next call.
struct CallGuard<'a> {
    channel: &'a Channel,
    done: bool,
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            let shared = &self.channel.handle.shared;
            shared.fail(Error::ChannelGone);
            let close = Method::ChannelClose(Close {
                reply_code: 200,
                reply_text: ShortString::default(),
                class_id: 0,
                method_id: 0,
            });
            shared.lock().closing = true;
            let _ = shared.io.send_method(shared.id, &close);
        }
    }
}

impl Channel {
    pub(crate) fn new(link: Arc<Link>, shared: Arc<ChannelShared>) -> Self {
        Channel {
            handle: Arc::new(ChannelHandle { _link: link, shared }),
        }
    }

    fn shared(&self) -> &ChannelShared {
        &self.handle.shared
    }

    /// The channel id.
    pub fn id(&self) -> u16 {
        self.shared().id
    }

    /// True until the channel failed or was closed.
    pub fn is_open(&self) -> bool {
        let st = self.shared().lock();
        st.error.is_none() && !st.closing
    }

    pub(crate) async fn open(&self) -> Result<()> {
        self.call(Method::ChannelOpen, None).await.map(|_| ())
    }

    async fn call(&self, method: Method, consumer: Option<mpsc::UnboundedSender<Result<Delivery>>>) -> Result<Method> {
        let shared = self.shared();
        let _one_at_a_time = shared.calls.lock().await;
        let (tx, rx) = oneshot::channel();
        let (reply, alt_reply) = reply_to(&method);
        {
            let mut st = shared.lock();
            if let Some(e) = &st.error {
                return Err(e.clone());
            }
            if st.closing && !matches!(method, Method::ChannelClose(_)) {
                return Err(Error::ChannelGone);
            }
            st.call = Some(Call {
                reply,
                alt_reply,
                tx,
                consumer,
            });
            shared.io.send_method(shared.id, &method)?;
        }
        let mut guard = CallGuard {
            channel: self,
            done: false,
        };
        let result = rx.await.unwrap_or(Err(Error::ChannelGone));
        guard.done = true;
        result
    }

    /// Closes the channel and waits for the broker to agree. Unacked deliveries return to
    /// their queues.
    pub async fn close(&self, code: u16, text: &str) -> Result<()> {
        {
            let mut st = self.shared().lock();
            if st.error.is_some() || st.closing {
                return Ok(());
            }
            st.closing = true;
        }
        let close = Method::ChannelClose(Close {
            reply_code: code,
            reply_text: ShortString::new(text.as_bytes().iter().copied().take(255).collect::<Vec<u8>>())?,
            class_id: 0,
            method_id: 0,
        });
        match self.call(close, None).await {
            Ok(_) | Err(Error::ChannelGone) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Deliveries on this channel from now on arrive without the headers keyed by one of `keys`
    /// (top-level only): their values are stepped over undecoded. For a consumer that would
    /// only drop them (a relay stripping the broker's dead-letter annotations); cheaper than
    /// decoding, copying and freeing them.
    pub fn skip_header_keys(&self, keys: &'static [&'static str]) {
        self.shared().lock().skipped_headers = keys;
    }

    /// As [`Channel::skip_header_keys`], except for deliveries whose routing key begins with
    /// `prefix`: those arrive with every header, for a consumer that reads them on those only.
    pub fn skip_header_keys_unless_routed(&self, keys: &'static [&'static str], prefix: &'static str) {
        let mut st = self.shared().lock();
        st.skipped_headers = keys;
        st.keep_headers_routed = Some(prefix);
    }

    /// `basic.qos` for this channel's consumers.
    pub async fn basic_qos(&self, prefetch_count: u16) -> Result<()> {
        self.call(
            Method::BasicQos {
                prefetch_count,
                global: false,
            },
            None,
        )
        .await
        .map(|_| ())
    }

    /// Puts the channel in confirm mode: from now on every publish is confirmed.
    pub async fn confirm_select(&self) -> Result<()> {
        self.call(Method::ConfirmSelect, None).await.map(|_| ())
    }

    /// Declares a queue.
    pub async fn queue_declare(&self, queue: &str, options: QueueOptions, arguments: FieldTable) -> Result<QueueInfo> {
        let method = Method::QueueDeclare {
            queue: ShortString::try_from(queue)?,
            passive: options.passive,
            durable: options.durable,
            exclusive: options.exclusive,
            auto_delete: options.auto_delete,
            arguments,
        };
        match self.call(method, None).await? {
            Method::QueueDeclareOk {
                queue,
                message_count,
                consumer_count,
            } => Ok(QueueInfo {
                name: queue,
                message_count,
                consumer_count,
            }),
            _ => Err(Error::Protocol("queue.declare answered with another method".into())),
        }
    }

    /// Checks that a queue exists and reads its counts (404 closes the channel if it does not).
    pub async fn queue_inspect(&self, queue: &str) -> Result<QueueInfo> {
        let options = QueueOptions {
            passive: true,
            ..Default::default()
        };
        self.queue_declare(queue, options, FieldTable::new()).await
    }

    /// Binds `queue` to `exchange` with `routing_key`.
    pub async fn queue_bind(
        &self,
        queue: &str,
        exchange: &str,
        routing_key: &str,
        arguments: FieldTable,
    ) -> Result<()> {
        let method = Method::QueueBind {
            queue: ShortString::try_from(queue)?,
            exchange: ShortString::try_from(exchange)?,
            routing_key: ShortString::try_from(routing_key)?,
            arguments,
        };
        self.call(method, None).await.map(|_| ())
    }

    /// Removes a binding.
    pub async fn queue_unbind(
        &self,
        queue: &str,
        exchange: &str,
        routing_key: &str,
        arguments: FieldTable,
    ) -> Result<()> {
        let method = Method::QueueUnbind {
            queue: ShortString::try_from(queue)?,
            exchange: ShortString::try_from(exchange)?,
            routing_key: ShortString::try_from(routing_key)?,
            arguments,
        };
        self.call(method, None).await.map(|_| ())
    }

    /// Binds exchange `destination` to exchange `source` with `routing_key` and `arguments`
    /// (RabbitMQ's exchange-to-exchange binding).
    pub async fn exchange_bind(
        &self,
        destination: &str,
        source: &str,
        routing_key: &str,
        arguments: FieldTable,
    ) -> Result<()> {
        let method = Method::ExchangeBind {
            destination: ShortString::try_from(destination)?,
            source: ShortString::try_from(source)?,
            routing_key: ShortString::try_from(routing_key)?,
            arguments,
        };
        self.call(method, None).await.map(|_| ())
    }

    /// Removes the binding of exchange `destination` to exchange `source` with `routing_key`
    /// and `arguments`.
    pub async fn exchange_unbind(
        &self,
        destination: &str,
        source: &str,
        routing_key: &str,
        arguments: FieldTable,
    ) -> Result<()> {
        let method = Method::ExchangeUnbind {
            destination: ShortString::try_from(destination)?,
            source: ShortString::try_from(source)?,
            routing_key: ShortString::try_from(routing_key)?,
            arguments,
        };
        self.call(method, None).await.map(|_| ())
    }

    /// Removes every ready message of `queue`; returns how many.
    pub async fn queue_purge(&self, queue: &str) -> Result<u32> {
        match self
            .call(
                Method::QueuePurge {
                    queue: ShortString::try_from(queue)?,
                },
                None,
            )
            .await?
        {
            Method::QueuePurgeOk { message_count } => Ok(message_count),
            _ => Err(Error::Protocol("queue.purge answered with another method".into())),
        }
    }

    /// Deletes `queue`; returns how many messages it held.
    pub async fn queue_delete(&self, queue: &str) -> Result<u32> {
        self.queue_delete_with(queue, false).await
    }

    /// Deletes `queue` only if it holds no message (`if-empty`; 406 closes the channel if it
    /// does). Classic queues only: RabbitMQ (3.10 to 4.3 measured) refuses the flag on a quorum
    /// queue with 540 NOT_IMPLEMENTED, which closes the whole connection.
    pub async fn queue_delete_if_empty(&self, queue: &str) -> Result<u32> {
        self.queue_delete_with(queue, true).await
    }

    async fn queue_delete_with(&self, queue: &str, if_empty: bool) -> Result<u32> {
        let method = Method::QueueDelete {
            queue: ShortString::try_from(queue)?,
            if_unused: false,
            if_empty,
        };
        match self.call(method, None).await? {
            Method::QueueDeleteOk { message_count } => Ok(message_count),
            _ => Err(Error::Protocol("queue.delete answered with another method".into())),
        }
    }

    /// Declares a durable (or not) exchange of `kind` (`direct`, `fanout`, `topic`, `headers`).
    pub async fn exchange_declare(
        &self,
        exchange: &str,
        kind: &str,
        durable: bool,
        arguments: FieldTable,
    ) -> Result<()> {
        let method = Method::ExchangeDeclare {
            exchange: ShortString::try_from(exchange)?,
            kind: ShortString::try_from(kind)?,
            passive: false,
            durable,
            auto_delete: false,
            internal: false,
            arguments,
        };
        self.call(method, None).await.map(|_| ())
    }

    /// Checks that an exchange exists (404 closes the channel if it does not).
    pub async fn exchange_inspect(&self, exchange: &str) -> Result<()> {
        let method = Method::ExchangeDeclare {
            exchange: ShortString::try_from(exchange)?,
            kind: ShortString::default(),
            passive: true,
            durable: false,
            auto_delete: false,
            internal: false,
            arguments: FieldTable::new(),
        };
        self.call(method, None).await.map(|_| ())
    }

    /// Deletes an exchange.
    pub async fn exchange_delete(&self, exchange: &str) -> Result<()> {
        let method = Method::ExchangeDelete {
            exchange: ShortString::try_from(exchange)?,
            if_unused: false,
        };
        self.call(method, None).await.map(|_| ())
    }

    /// Starts a consumer on `queue` (acks required); `tag` empty lets the broker pick one.
    pub async fn basic_consume(
        &self,
        queue: &str,
        tag: &str,
        exclusive: bool,
        arguments: FieldTable,
    ) -> Result<Consumer> {
        let (tx, rx) = mpsc::unbounded_channel();
        let method = Method::BasicConsume {
            queue: ShortString::try_from(queue)?,
            consumer_tag: ShortString::try_from(tag)?,
            no_ack: false,
            exclusive,
            arguments,
        };
        match self.call(method, Some(tx)).await? {
            Method::BasicConsumeOk { consumer_tag } => Ok(Consumer { tag: consumer_tag, rx }),
            _ => Err(Error::Protocol("basic.consume answered with another method".into())),
        }
    }

    /// Cancels a consumer and waits for the broker to agree; its stream then ends.
    pub async fn basic_cancel(&self, tag: &ShortString) -> Result<()> {
        let method = Method::BasicCancel {
            consumer_tag: tag.clone(),
            no_wait: false,
        };
        self.call(method, None).await.map(|_| ())
    }

    /// Acks one delivery (or every one up to it, with `multiple`). Sent, not awaited.
    pub fn basic_ack(&self, delivery_tag: u64, multiple: bool) -> Result<()> {
        self.send_settle(&Method::BasicAck { delivery_tag, multiple })
    }

    /// Nacks one delivery; with `requeue` it goes back to its queue.
    pub fn basic_nack(&self, delivery_tag: u64, multiple: bool, requeue: bool) -> Result<()> {
        self.send_settle(&Method::BasicNack {
            delivery_tag,
            multiple,
            requeue,
        })
    }

    /// Rejects one delivery; with `requeue` it goes back to its queue.
    pub fn basic_reject(&self, delivery_tag: u64, requeue: bool) -> Result<()> {
        self.send_settle(&Method::BasicReject { delivery_tag, requeue })
    }

    fn send_settle(&self, method: &Method) -> Result<()> {
        let shared = self.shared();
        {
            let st = shared.lock();
            if let Some(e) = &st.error {
                return Err(e.clone());
            }
            if st.closing {
                return Err(Error::ChannelGone);
            }
        }
        shared.io.send_method(shared.id, method)
    }

    /// Publishes; in confirm mode the returned future resolves with the broker's answer.
    /// Nothing is awaited here: the frames are queued for the writer, in order.
    /// Exchange and routing key are bytes: `&str` or `&[u8]`.
    pub fn basic_publish(
        &self,
        exchange: impl AsRef<[u8]>,
        routing_key: impl AsRef<[u8]>,
        mandatory: bool,
        properties: &BasicProperties,
        body: &[u8],
    ) -> Result<PublishConfirm> {
        self.basic_publish_carrying(exchange, routing_key, mandatory, properties, None, body)
    }

    /// [`basic_publish`](Self::basic_publish) with the headers `carried` makes (entries carried
    /// over from another table — a delivery's — then its own) instead of the properties'
    /// `headers`: a relay republishes what it received without copying the table first. The
    /// return fingerprint is the same as for `basic_publish` (it reads no headers).
    pub fn basic_publish_carrying(
        &self,
        exchange: impl AsRef<[u8]>,
        routing_key: impl AsRef<[u8]>,
        mandatory: bool,
        properties: &BasicProperties,
        carried: Option<Carried<'_>>,
        body: &[u8],
    ) -> Result<PublishConfirm> {
        self.publish_with(
            exchange.as_ref(),
            routing_key.as_ref(),
            mandatory,
            properties,
            body,
            |out| properties.encode_carrying(out, carried.as_ref()),
        )
    }

    /// Publishes with property bytes as received ([`Undecodable::bytes`]), unchanged — for
    /// properties this client could not decode, so they cannot be rebuilt.
    pub fn basic_publish_raw(
        &self,
        exchange: &[u8],
        routing_key: &[u8],
        mandatory: bool,
        raw_properties: &[u8],
        body: &[u8],
    ) -> Result<PublishConfirm> {
        let nothing = BasicProperties::default();
        self.publish_with(exchange, routing_key, mandatory, &nothing, body, |out| {
            out.put_slice(raw_properties)
        })
    }

    fn publish_with(
        &self,
        exchange: &[u8],
        routing_key: &[u8],
        mandatory: bool,
        properties: &BasicProperties,
        body: &[u8],
        encode_properties: impl FnOnce(&mut BytesMut),
    ) -> Result<PublishConfirm> {
        if exchange.len() > 255 || routing_key.len() > 255 {
            return Err(crate::types::TooLong(exchange.len().max(routing_key.len())).into());
        }
        let shared = self.shared();
        let io = &shared.io;
        let chunk = io.frame_max - FRAME_OVERHEAD;
        let mut st = shared.lock();
        if let Some(e) = &st.error {
            return Err(e.clone());
        }
        if st.closing {
            return Err(Error::ChannelGone);
        }
        let id = shared.id;
        let write = |out: &mut BytesMut| {
            out.reserve(64 + exchange.len() + routing_key.len() + body.len() + (body.len() / chunk + 1) * 8);
            frame::put(out, frame::METHOD, id, |b| {
                put_publish(b, exchange, routing_key, mandatory).expect("lengths checked above")
            });
            put_content_header(out, id, body.len() as u64, encode_properties);
            for piece in body.chunks(chunk) {
                frame::put(out, frame::BODY, id, |b| b.put_slice(piece));
            }
        };
        match st.confirms.as_mut() {
            None => {
                io.send(write)?;
                Ok(PublishConfirm(ConfirmState::Ready(Some(Confirmation::NotRequested))))
            }
            Some(confirms) => {
                let tag = confirms.next_tag;
                io.send(write)?;
                confirms.next_tag += 1;
                let (tx, rx) = oneshot::channel();
                let fingerprint = Fingerprint::new(exchange, routing_key, properties, body);
                confirms.pending.insert(
                    tag,
                    Pending {
                        fingerprint,
                        returned: None,
                        tx,
                    },
                );
                Ok(PublishConfirm(ConfirmState::Waiting(rx)))
            }
        }
    }
}
