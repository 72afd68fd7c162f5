//! A connection: the handshake, then one task reading frames and one writing them, and the
//! channels multiplexed over it.
//!
//! Frames go out through one buffer that a writer task drains: a caller appends a whole publish
//! (method, header and body frames) under the buffer's lock, so frames of one channel never
//! interleave, and a burst of publishes and acks leaves in one `write`. A publish takes its
//! confirm tag and enters the buffer under the channel's lock, so tags follow the order the
//! broker receives publishes in.
//!
//! The reader task decodes every frame and hands it to its channel synchronously: replies to
//! the channel's one outstanding call, deliveries to consumers, confirms and returns to the
//! publisher table ([`crate::channel`]). Nothing a broker may legally send — a short string of
//! any bytes, a header of any depth — stops it: properties that do not decode are handed on as
//! bytes, with the delivery.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{Notify, oneshot, watch};
use tracing::{debug, info, warn};

use crate::channel::{Channel, ChannelShared};
use crate::error::{CloseReason, Error, Result};
use crate::frame::{self, Frame, PROTOCOL_HEADER};
use crate::io::{Io, IoState, Link};
use crate::method::{Close, Method};
use crate::tls::TlsOptions;
use crate::types::{FieldTable, FieldValue, LongString, ShortString};
use crate::uri::AmqpUri;

/// Heartbeat interval asked for when the URI names none: a broker that dies without closing
/// the socket (a lost machine, a partition) is noticed within two intervals.
pub const DEFAULT_HEARTBEAT_SECS: u16 = 10;

/// How long the handshake may take when the URI names no `connection_timeout`.
pub const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(15);

/// Frames larger than this are refused during the handshake, before `frame_max` is agreed
/// (`connection.start` carries the server's properties; RabbitMQ's are about 1 KiB).
const HANDSHAKE_FRAME_MAX: usize = 1 << 20;

/// The socket is read into a buffer of at least this many bytes.
const READ_BUFFER: usize = 64 * 1024;

/// How to open a connection.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// The broker.
    pub uri: AmqpUri,
    /// Shown in the management UI (`connection_name` client property).
    pub connection_name: Option<String>,
    /// Certificates for `amqps://` (the platform's roots when `None`).
    pub tls: Option<TlsOptions>,
    /// How long the broker may stay silent (no frame at all, heartbeats included) before the
    /// connection counts as dead; `None`: two heartbeat intervals. RabbitMQ sends a heartbeat
    /// only after an interval in which it sent nothing, checked once per interval, so its
    /// frames on an idle connection can be up to two intervals apart: a bound of two intervals
    /// exactly can fire on a healthy idle connection, so give it some margin (Ladder: three).
    /// Ignored while heartbeats are off.
    pub dead_after: Option<Duration>,
}

impl ConnectOptions {
    /// Options for `uri` with no name and default TLS.
    pub fn new(uri: AmqpUri) -> Self {
        ConnectOptions {
            uri,
            connection_name: None,
            tls: None,
            dead_after: None,
        }
    }
}

/// An open connection. Cheap to clone; the last clone dropped closes the socket.
#[derive(Clone)]
pub struct Connection {
    pub(crate) inner: Arc<Link>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("frame_max", &self.inner.io.frame_max)
            .field("open", &self.is_open())
            .finish()
    }
}

impl Connection {
    /// Connects, logs in and opens the virtual host, within the URI's `connection_timeout`.
    pub async fn connect(options: &ConnectOptions) -> Result<Connection> {
        let timeout = options.uri.connection_timeout.unwrap_or(DEFAULT_CONNECTION_TIMEOUT);
        match tokio::time::timeout(timeout, Self::connect_inner(options)).await {
            Ok(result) => result,
            Err(_) => Err(Error::Io(Arc::new(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "connecting to {}:{} took longer than {timeout:?}",
                    options.uri.host, options.uri.port
                ),
            )))),
        }
    }

    async fn connect_inner(options: &ConnectOptions) -> Result<Connection> {
        let uri = &options.uri;
        let tcp = TcpStream::connect((uri.host.as_str(), uri.port)).await?;
        tcp.set_nodelay(true)?;
        if uri.tls {
            let tls = crate::tls::connect(tcp, &uri.host, options.tls.as_ref()).await?;
            let (read, write) = tokio::io::split(tls);
            Self::handshake(read, write, options)
                .await
                .map_err(crate::tls::explain_late_alert)
        } else {
            let (read, write) = tcp.into_split();
            Self::handshake(read, write, options).await
        }
    }

    async fn handshake<R, W>(mut read: R, mut write: W, options: &ConnectOptions) -> Result<Connection>
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let uri = &options.uri;
        let mut buf = BytesMut::with_capacity(READ_BUFFER);
        write.write_all(PROTOCOL_HEADER).await?;

        let (server_properties, mechanisms) = match next_method(&mut read, &mut buf).await? {
            Method::ConnectionStart {
                server_properties,
                mechanisms,
                ..
            } => (server_properties, mechanisms),
            other => return Err(unexpected("connection.start", &other)),
        };
        let (start_ok, mechanism) = start_ok(options, &mechanisms)?;
        let mut out = BytesMut::new();
        frame::put(&mut out, frame::METHOD, 0, |b| start_ok.encode(b));
        write.write_all(&out).await?;

        let (channel_max, frame_max, heartbeat) = match next_method(&mut read, &mut buf).await? {
            Method::ConnectionTune {
                channel_max,
                frame_max,
                heartbeat,
            } => (channel_max, frame_max, heartbeat),
            Method::ConnectionSecure { .. } => {
                return Err(Error::Auth(format!(
                    "{mechanism} needs no challenge, the broker sent one"
                )));
            }
            Method::ConnectionClose(close) => return Err(Error::Auth(CloseReason::from(&close).to_string())),
            other => return Err(unexpected("connection.tune", &other)),
        };
        let (channel_max, frame_max, heartbeat) = tuned(uri, channel_max, frame_max, heartbeat);
        let mut out = BytesMut::new();
        let tune_ok = Method::ConnectionTuneOk {
            channel_max,
            frame_max,
            heartbeat,
        };
        frame::put(&mut out, frame::METHOD, 0, |b| tune_ok.encode(b));
        let open = Method::ConnectionOpen {
            vhost: ShortString::try_from(uri.vhost.as_str())?,
        };
        frame::put(&mut out, frame::METHOD, 0, |b| open.encode(b));
        write.write_all(&out).await?;
        match next_method(&mut read, &mut buf).await? {
            Method::ConnectionOpenOk => {}
            Method::ConnectionClose(close) => return Err(Error::ConnectionClosed(CloseReason::from(&close))),
            other => return Err(unexpected("connection.open-ok", &other)),
        }

        let heartbeat = (heartbeat > 0).then(|| Duration::from_secs(u64::from(heartbeat)));
        let (closed_tx, _) = watch::channel(None);
        let io = Arc::new(Io {
            out: Mutex::new(BytesMut::with_capacity(64 * 1024)),
            wake: Notify::new(),
            closed: AtomicBool::new(false),
            state: Mutex::new(IoState {
                next_channel: 1,
                ..Default::default()
            }),
            closed_tx,
            frame_max: frame_max as usize,
            channel_max,
            heartbeat,
            dead_after: heartbeat.map(|h| options.dead_after.unwrap_or(h * 2)),
            server_properties,
            blocked: watch::Sender::new(None),
        });
        let reader = tokio::spawn(read_loop(io.clone(), read, buf));
        let writer = tokio::spawn(write_loop(io.clone(), write));
        Ok(Connection {
            inner: Arc::new(Link {
                io,
                tasks: vec![reader.abort_handle(), writer.abort_handle()],
            }),
        })
    }

    /// Opens a channel.
    pub async fn create_channel(&self) -> Result<Channel> {
        let io = &self.inner.io;
        let shared = {
            let mut state = io.lock_state();
            if let Some(e) = &state.error {
                return Err(e.clone());
            }
            let max = io.channel_max;
            let start = state.next_channel;
            let mut id = start;
            while state.channels.contains_key(&id) {
                id = if id >= max { 1 } else { id + 1 };
                if id == start {
                    return Err(Error::NoChannel(max));
                }
            }
            state.next_channel = if id >= max { 1 } else { id + 1 };
            let shared = Arc::new(ChannelShared::new(id, io.clone()));
            state.channels.insert(id, shared.clone());
            shared
        };
        let channel = Channel::new(self.inner.clone(), shared);
        channel.open().await?;
        Ok(channel)
    }

    /// The broker's `connection.start` properties (product, version, capabilities …).
    pub fn server_properties(&self) -> &FieldTable {
        &self.inner.io.server_properties
    }

    /// The broker's version (`version` server property), e.g. `(4, 3, 6)`.
    pub fn server_version(&self) -> Option<(u32, u32, u32)> {
        let text = match self.server_properties().get("version")? {
            FieldValue::LongString(s) => s.to_str()?.to_string(),
            _ => return None,
        };
        let mut parts = text.split(|c: char| !c.is_ascii_digit()).filter(|p| !p.is_empty());
        let major = parts.next()?.parse().ok()?;
        let minor = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        let patch = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        Some((major, minor, patch))
    }

    /// The agreed maximum frame size.
    pub fn frame_max(&self) -> usize {
        self.inner.io.frame_max
    }

    /// The agreed heartbeat interval (`None`: off).
    pub fn heartbeat(&self) -> Option<Duration> {
        self.inner.io.heartbeat
    }

    /// True until the connection failed or was closed.
    pub fn is_open(&self) -> bool {
        !self.inner.io.closed.load(Ordering::Acquire)
    }

    /// True while the broker says it blocks publishers (memory or disk alarm).
    ///
    /// While blocked, RabbitMQ stops reading the socket once the connection publishes: publishes
    /// and acks wait in the socket's buffers (their confirms come after the alarm clears), and
    /// the broker does not count our heartbeats as missed. A blocked connection is alive.
    pub fn is_blocked(&self) -> bool {
        self.inner.io.blocked.borrow().is_some()
    }

    /// The broker's reason while it blocks publishers (`connection.blocked`, e.g. "low on
    /// memory"), `None` otherwise.
    pub fn blocked_reason(&self) -> Option<String> {
        self.inner.io.blocked.borrow().clone()
    }

    /// Follows [`Connection::blocked_reason`]: the receiver sees every change; it ends (its
    /// `changed` fails) once the connection is dropped.
    pub fn blocked_changes(&self) -> watch::Receiver<Option<String>> {
        self.inner.io.blocked.subscribe()
    }

    /// Resolves with the error once the connection has failed or was closed.
    pub async fn closed(&self) -> Error {
        let mut rx = self.inner.io.closed_tx.subscribe();
        loop {
            if let Some(e) = rx.borrow_and_update().clone() {
                return e;
            }
            if rx.changed().await.is_err() {
                return Error::ConnectionGone;
            }
        }
    }

    /// Closes the connection and waits for the broker to agree; every channel closes with it.
    pub async fn close(&self, code: u16, text: &str) -> Result<()> {
        let io = &self.inner.io;
        let (tx, rx) = oneshot::channel();
        {
            let mut state = io.lock_state();
            if let Some(e) = &state.error {
                return match e {
                    Error::ConnectionGone => Ok(()),
                    other => Err(other.clone()),
                };
            }
            state.close_ok = Some(tx);
        }
        let close = Method::ConnectionClose(Close {
            reply_code: code,
            reply_text: ShortString::new(text.as_bytes().iter().copied().take(255).collect::<Vec<u8>>())?,
            class_id: 0,
            method_id: 0,
        });
        io.send_method(0, &close)?;
        let _ = rx.await;
        io.fail(Error::ConnectionGone);
        Ok(())
    }
}

fn client_properties(name: Option<&str>) -> FieldTable {
    let mut capabilities = FieldTable::new();
    for cap in [
        "publisher_confirms",
        "exchange_exchange_bindings",
        "basic.nack",
        "consumer_cancel_notify",
        "connection.blocked",
        "authentication_failure_close",
    ] {
        capabilities.set(cap, FieldValue::Boolean(true));
    }
    let mut props = FieldTable::new();
    props.set("product", FieldValue::string("ladder"));
    props.set("version", FieldValue::string(env!("CARGO_PKG_VERSION")));
    props.set("platform", FieldValue::string("Rust"));
    props.set("capabilities", FieldValue::FieldTable(capabilities));
    if let Some(name) = name {
        props.set("connection_name", FieldValue::string(name));
    }
    props
}

fn unexpected(wanted: &str, got: &Method) -> Error {
    let (class, method) = got.id();
    Error::Protocol(format!("expected {wanted}, the broker sent method {class}.{method}"))
}

/// Reads until one whole method frame on channel 0 arrived (handshake only).
async fn next_method<R: AsyncRead + Unpin>(read: &mut R, buf: &mut BytesMut) -> Result<Method> {
    loop {
        if buf.starts_with(b"AMQP") && buf.len() >= 8 {
            return Err(Error::Protocol(format!(
                "the broker does not speak AMQP 0-9-1 (it answered with protocol header {:?})",
                &buf[..8]
            )));
        }
        match frame::parse(buf, HANDSHAKE_FRAME_MAX).map_err(|e| Error::Protocol(e.to_string()))? {
            Some(Frame {
                kind: frame::METHOD,
                payload,
                ..
            }) => return Method::decode(&payload).map_err(|e| Error::Protocol(e.to_string())),
            Some(_) => continue,
            None => {
                if read.read_buf(buf).await? == 0 {
                    return Err(Error::Io(Arc::new(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the broker closed the socket during the handshake",
                    ))));
                }
            }
        }
    }
}

async fn read_loop<R: AsyncRead + Unpin>(io: Arc<Io>, mut read: R, mut buf: BytesMut) {
    let error = read_frames(&io, &mut read, &mut buf).await;
    debug!(%error, "connection reader stopped");
    io.fail(error);
}

async fn read_frames<R: AsyncRead + Unpin>(io: &Io, read: &mut R, buf: &mut BytesMut) -> Error {
    let silence = io.dead_after;
    loop {
        loop {
            match frame::parse(buf, io.frame_max) {
                Ok(Some(frame)) => {
                    if let Err(e) = dispatch(io, frame) {
                        return e;
                    }
                }
                Ok(None) => break,
                Err(e) => return Error::Protocol(e.to_string()),
            }
        }
        if io.closed.load(Ordering::Acquire) {
            return io.error();
        }
        if buf.capacity() - buf.len() < READ_BUFFER / 4 {
            buf.reserve(READ_BUFFER);
        }
        let read = read.read_buf(buf);
        let n = match silence {
            Some(limit) => match tokio::time::timeout(limit, read).await {
                Ok(r) => r,
                Err(_) => return Error::HeartbeatTimeout(limit.as_secs_f64().ceil() as u64),
            },
            None => read.await,
        };
        match n {
            Ok(0) => {
                return Error::Io(Arc::new(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the broker closed the socket",
                )));
            }
            Ok(_) => {}
            Err(e) => return e.into(),
        }
    }
}

fn dispatch(io: &Io, frame: Frame) -> Result<()> {
    if frame.kind == frame::HEARTBEAT {
        return Ok(());
    }
    if frame.channel == 0 {
        if frame.kind != frame::METHOD {
            return Err(Error::Protocol(format!("frame type {} on channel 0", frame.kind)));
        }
        let method = Method::decode(&frame.payload).map_err(|e| Error::Protocol(e.to_string()))?;
        return match method {
            Method::ConnectionClose(close) => {
                let _ = io.send_method(0, &Method::ConnectionCloseOk);
                Err(Error::ConnectionClosed(CloseReason::from(&close)))
            }
            Method::ConnectionCloseOk => {
                if let Some(tx) = io.lock_state().close_ok.take() {
                    let _ = tx.send(());
                }
                Err(Error::ConnectionGone)
            }
            Method::ConnectionBlocked { reason } => {
                let reason = String::from_utf8_lossy(reason.as_bytes()).into_owned();
                warn!(reason = %reason, "the broker blocks publishers (a resource alarm); publishes wait until it unblocks");
                io.blocked.send_replace(Some(reason));
                Ok(())
            }
            Method::ConnectionUnblocked => {
                if io.blocked.send_replace(None).is_some() {
                    info!("the broker unblocked publishers");
                }
                Ok(())
            }
            other => Err(unexpected("a connection method", &other)),
        };
    }
    match io.channel(frame.channel) {
        Some(channel) => channel.receive(frame),
        // frames for a channel already closed on this side are discarded (AMQP 0-9-1 §2.2.4)
        None => Ok(()),
    }
}

async fn write_loop<W: AsyncWrite + Unpin>(io: Arc<Io>, mut write: W) {
    let beat = io.heartbeat.map(|h| h / 2);
    loop {
        let chunk = {
            let mut out = io.out.lock().unwrap_or_else(|e| e.into_inner());
            (!out.is_empty()).then(|| out.split())
        };
        let result = match chunk {
            Some(mut chunk) => {
                let written = write.write_all_buf(&mut chunk).await;
                if written.is_ok() && io.out.lock().map(|o| o.is_empty()).unwrap_or(true) {
                    write.flush().await
                } else {
                    written
                }
            }
            None => {
                if io.closed.load(Ordering::Acquire) {
                    let _ = write.shutdown().await;
                    return;
                }
                match beat {
                    Some(beat) => tokio::select! {
                        () = io.wake.notified() => Ok(()),
                        () = tokio::time::sleep(beat) => {
                            let mut hb = BytesMut::with_capacity(8);
                            frame::put_heartbeat(&mut hb);
                            write.write_all(&hb).await
                        }
                    },
                    None => {
                        io.wake.notified().await;
                        Ok(())
                    }
                }
            }
        };
        if let Err(e) = result {
            io.fail(e.into());
            return;
        }
    }
}

/// The `connection.start-ok` for the broker's `mechanisms`: EXTERNAL with a client certificate,
/// else PLAIN with the URI's user and password; and the mechanism's name.
fn start_ok(options: &ConnectOptions, mechanisms: &LongString) -> Result<(Method, &'static str)> {
    let uri = &options.uri;
    let (mechanism, response) = if uri.external_auth {
        ("EXTERNAL", LongString::from(""))
    } else {
        let mut r = Vec::with_capacity(uri.user.len() + uri.password.len() + 2);
        r.push(0);
        r.extend_from_slice(uri.user.as_bytes());
        r.push(0);
        r.extend_from_slice(uri.password.as_bytes());
        ("PLAIN", LongString::from(r))
    };
    let offered = mechanisms
        .to_str()
        .unwrap_or_default()
        .split(' ')
        .any(|m| m == mechanism);
    if !offered {
        return Err(Error::Auth(format!(
            "the broker offers {:?}, not {mechanism}",
            String::from_utf8_lossy(mechanisms.as_bytes())
        )));
    }
    let start_ok = Method::ConnectionStartOk {
        client_properties: client_properties(options.connection_name.as_deref()),
        mechanism: ShortString::try_from(mechanism)?,
        response,
        locale: ShortString::try_from("en_US")?,
    };
    Ok((start_ok, mechanism))
}

/// The channel-max, frame-max and heartbeat both sides agree on: the lower of two limits, where
/// 0 means none (a heartbeat of 0 on our side turns it off).
fn tuned(uri: &AmqpUri, channel_max: u16, frame_max: u32, heartbeat: u16) -> (u16, u32, u16) {
    let negotiate = |ours: u32, theirs: u32| match (ours, theirs) {
        (0, t) => t,
        (o, 0) => o,
        (o, t) => o.min(t),
    };
    let frame_max = negotiate(uri.frame_max.unwrap_or(0), frame_max).max(4096);
    let channel_max = match negotiate(u32::from(uri.channel_max.unwrap_or(0)), u32::from(channel_max)) {
        0 => u16::MAX,
        n => n as u16,
    };
    let heartbeat = match (uri.heartbeat.unwrap_or(DEFAULT_HEARTBEAT_SECS), heartbeat) {
        (0, _) => 0,
        (ours, 0) => ours,
        (ours, theirs) => ours.min(theirs),
    };
    (channel_max, frame_max, heartbeat)
}
