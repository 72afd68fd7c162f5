//! Errors of the client.

use std::fmt;
use std::sync::Arc;

use crate::method::Close;
use crate::types::TooLong;

/// Why a connection or channel was closed by its peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloseReason {
    /// The AMQP reply code (320 connection forced, 404 not found, 406 precondition failed …).
    pub code: u16,
    /// The broker's text, lossy UTF-8.
    pub text: String,
    /// Class and method that caused it, or (0, 0).
    pub method: (u16, u16),
}

impl From<&Close> for CloseReason {
    fn from(c: &Close) -> Self {
        CloseReason {
            code: c.reply_code,
            text: c.reply_text.to_string_lossy().into_owned(),
            method: (c.class_id, c.method_id),
        }
    }
}

impl fmt::Display for CloseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.code, self.text)
    }
}

/// What went wrong.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The socket failed, or the peer closed it without a word.
    #[error("i/o error: {0}")]
    Io(Arc<std::io::Error>),
    /// The broker closed the connection.
    #[error("the broker closed the connection: {0}")]
    ConnectionClosed(CloseReason),
    /// The broker closed the channel.
    #[error("the broker closed the channel: {0}")]
    ChannelClosed(CloseReason),
    /// The connection was closed by this side (or dropped).
    #[error("the connection is closed")]
    ConnectionGone,
    /// The channel was closed by this side.
    #[error("the channel is closed")]
    ChannelGone,
    /// The peer broke the protocol (a frame that does not parse, an unexpected method).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A name or value longer than a short string may be.
    #[error(transparent)]
    TooLong(#[from] TooLong),
    /// The broker refused the credentials.
    #[error("the broker refused the login: {0}")]
    Auth(String),
    /// Setting up TLS failed.
    #[error("tls: {0}")]
    Tls(String),
    /// The URI does not parse.
    #[error("bad broker uri: {0}")]
    Uri(String),
    /// The broker missed its heartbeats.
    #[error("no frame from the broker for {0} s (missed heartbeats)")]
    HeartbeatTimeout(u64),
    /// No channel id is free.
    #[error("no free channel id (channel_max {0})")]
    NoChannel(u16),
}

impl Error {
    /// The AMQP reply code when the broker closed the channel or connection.
    pub fn reply_code(&self) -> Option<u16> {
        match self {
            Error::ConnectionClosed(r) | Error::ChannelClosed(r) => Some(r.code),
            _ => None,
        }
    }

    /// True when only a channel failed and the connection may still serve others.
    pub fn is_channel_only(&self) -> bool {
        matches!(self, Error::ChannelClosed(_) | Error::ChannelGone)
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(Arc::new(e))
    }
}

/// The client's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
