//! What a connection's reader task, writer task and channels share: the outgoing frame buffer,
//! the table of open channels, and the connection's failure. Channels are registered as
//! [`Endpoint`]s, so this knows nothing of what a channel does with its frames.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::{Buf, BufMut, BytesMut};
use tokio::sync::{Notify, oneshot, watch};
use tokio::task::AbortHandle;

use crate::error::{Error, Result};
use crate::frame::{self, Frame};
use crate::method::Method;
use crate::types::FieldTable;

/// A channel as the connection sees it: it takes the frames for its id, and fails with the
/// connection.
pub(crate) trait Endpoint: Send + Sync {
    /// Handles one frame for this channel (the reader task calls it).
    fn receive(&self, frame: Frame) -> Result<()>;
    /// Fails everything waiting on the channel.
    fn fail(&self, error: Error);
}

/// Keeps a connection's tasks alive: the last owner dropped (the last `Connection` or
/// `Channel`) fails the connection and stops its tasks, which closes the socket.
pub(crate) struct Link {
    pub(crate) io: Arc<Io>,
    pub(crate) tasks: Vec<AbortHandle>,
}

impl Drop for Link {
    fn drop(&mut self) {
        self.io.fail(Error::ConnectionGone);
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// What the reader, the writer and every channel share.
pub(crate) struct Io {
    pub(crate) out: Mutex<BytesMut>,
    pub(crate) wake: Notify,
    pub(crate) closed: AtomicBool,
    pub(crate) state: Mutex<IoState>,
    pub(crate) closed_tx: watch::Sender<Option<Error>>,
    pub(crate) frame_max: usize,
    pub(crate) channel_max: u16,
    pub(crate) heartbeat: Option<Duration>,
    /// Silence after which the reader fails the connection (`None` while heartbeats are off).
    pub(crate) dead_after: Option<Duration>,
    pub(crate) server_properties: FieldTable,
    /// `Some(reason)` while the broker blocks this connection's publishes (`connection.blocked`).
    pub(crate) blocked: watch::Sender<Option<String>>,
}

#[derive(Default)]
pub(crate) struct IoState {
    pub(crate) error: Option<Error>,
    pub(crate) channels: HashMap<u16, Arc<dyn Endpoint>>,
    pub(crate) next_channel: u16,
    pub(crate) close_ok: Option<oneshot::Sender<()>>,
}

impl Io {
    pub(crate) fn lock_state(&self) -> MutexGuard<'_, IoState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends frames with `write` and wakes the writer; fails once the connection is closed.
    pub(crate) fn send<T>(&self, write: impl FnOnce(&mut BytesMut) -> T) -> Result<T> {
        if self.closed.load(Ordering::Acquire) {
            return Err(self.error());
        }
        let result = {
            let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
            write(&mut out)
        };
        self.wake.notify_one();
        Ok(result)
    }

    /// Appends one method frame on `channel`.
    pub(crate) fn send_method(&self, channel: u16, method: &Method) -> Result<()> {
        self.send(|out| frame::put(out, frame::METHOD, channel, |b| method.encode(b)))
    }

    /// The error the connection failed with (or `ConnectionGone`).
    pub(crate) fn error(&self) -> Error {
        self.lock_state().error.clone().unwrap_or(Error::ConnectionGone)
    }

    /// Marks the connection failed and fails every channel with `error`; the first error wins.
    pub(crate) fn fail(&self, error: Error) {
        let channels = {
            let mut state = self.lock_state();
            if state.error.is_some() {
                return;
            }
            state.error = Some(error.clone());
            self.closed.store(true, Ordering::Release);
            state.close_ok.take();
            std::mem::take(&mut state.channels)
        };
        for (_, channel) in channels {
            channel.fail(error.clone());
        }
        self.closed_tx.send_replace(Some(error));
        self.wake.notify_one();
    }

    pub(crate) fn remove_channel(&self, id: u16) {
        self.lock_state().channels.remove(&id);
    }

    pub(crate) fn channel(&self, id: u16) -> Option<Arc<dyn Endpoint>> {
        self.lock_state().channels.get(&id).cloned()
    }
}

/// Reads a content header payload: class, weight, body size; the properties follow.
pub(crate) fn content_header(payload: &[u8]) -> Result<(u64, &[u8])> {
    let mut p = payload;
    if p.remaining() < 12 {
        return Err(Error::Protocol("content header shorter than 12 bytes".into()));
    }
    let _class = p.get_u16();
    let _weight = p.get_u16();
    let size = p.get_u64();
    Ok((size, p))
}

/// Appends a content header frame for `size` bytes of body with `properties` already encoded.
pub(crate) fn put_content_header(out: &mut BytesMut, channel: u16, size: u64, properties: impl FnOnce(&mut BytesMut)) {
    frame::put(out, frame::HEADER, channel, |b| {
        b.put_u16(60);
        b.put_u16(0);
        b.put_u64(size);
        properties(b);
    });
}
