//! The methods this client sends and receives, with their wire encoding.
//!
//! Only the methods Ladder uses are here, but every method a broker may send to a client using
//! them decodes (or is named in the error), so an unexpected one is reported, not misread.

use bytes::{BufMut, BytesMut};

use crate::types::{
    DecodeError, FieldTable, LongString, Reader, ShortString, TooLong, put_long_bytes, put_short_bytes,
    put_short_string, put_table,
};

/// A method with its arguments.
#[derive(Debug, Clone, PartialEq)]
#[allow(missing_docs)]
pub enum Method {
    ConnectionStart {
        version_major: u8,
        version_minor: u8,
        server_properties: FieldTable,
        mechanisms: LongString,
        locales: LongString,
    },
    ConnectionStartOk {
        client_properties: FieldTable,
        mechanism: ShortString,
        response: LongString,
        locale: ShortString,
    },
    ConnectionSecure {
        challenge: LongString,
    },
    ConnectionSecureOk {
        response: LongString,
    },
    ConnectionTune {
        channel_max: u16,
        frame_max: u32,
        heartbeat: u16,
    },
    ConnectionTuneOk {
        channel_max: u16,
        frame_max: u32,
        heartbeat: u16,
    },
    ConnectionOpen {
        vhost: ShortString,
    },
    ConnectionOpenOk,
    ConnectionClose(Close),
    ConnectionCloseOk,
    ConnectionBlocked {
        reason: ShortString,
    },
    ConnectionUnblocked,
    ChannelOpen,
    ChannelOpenOk,
    ChannelFlow {
        active: bool,
    },
    ChannelFlowOk {
        active: bool,
    },
    ChannelClose(Close),
    ChannelCloseOk,
    ExchangeDeclare {
        exchange: ShortString,
        kind: ShortString,
        passive: bool,
        durable: bool,
        auto_delete: bool,
        internal: bool,
        arguments: FieldTable,
    },
    ExchangeDeclareOk,
    ExchangeDelete {
        exchange: ShortString,
        if_unused: bool,
    },
    ExchangeDeleteOk,
    /// RabbitMQ's exchange-to-exchange binding (`exchange.bind`).
    ExchangeBind {
        destination: ShortString,
        source: ShortString,
        routing_key: ShortString,
        arguments: FieldTable,
    },
    ExchangeBindOk,
    ExchangeUnbind {
        destination: ShortString,
        source: ShortString,
        routing_key: ShortString,
        arguments: FieldTable,
    },
    ExchangeUnbindOk,
    QueueDeclare {
        queue: ShortString,
        passive: bool,
        durable: bool,
        exclusive: bool,
        auto_delete: bool,
        arguments: FieldTable,
    },
    QueueDeclareOk {
        queue: ShortString,
        message_count: u32,
        consumer_count: u32,
    },
    QueueBind {
        queue: ShortString,
        exchange: ShortString,
        routing_key: ShortString,
        arguments: FieldTable,
    },
    QueueBindOk,
    QueueUnbind {
        queue: ShortString,
        exchange: ShortString,
        routing_key: ShortString,
        arguments: FieldTable,
    },
    QueueUnbindOk,
    QueuePurge {
        queue: ShortString,
    },
    QueuePurgeOk {
        message_count: u32,
    },
    QueueDelete {
        queue: ShortString,
        if_unused: bool,
        if_empty: bool,
    },
    QueueDeleteOk {
        message_count: u32,
    },
    BasicQos {
        prefetch_count: u16,
        global: bool,
    },
    BasicQosOk,
    BasicConsume {
        queue: ShortString,
        consumer_tag: ShortString,
        no_ack: bool,
        exclusive: bool,
        arguments: FieldTable,
    },
    BasicConsumeOk {
        consumer_tag: ShortString,
    },
    BasicCancel {
        consumer_tag: ShortString,
        no_wait: bool,
    },
    BasicCancelOk {
        consumer_tag: ShortString,
    },
    BasicPublish {
        exchange: ShortString,
        routing_key: ShortString,
        mandatory: bool,
    },
    BasicReturn {
        reply_code: u16,
        reply_text: ShortString,
        exchange: ShortString,
        routing_key: ShortString,
    },
    BasicDeliver {
        consumer_tag: ShortString,
        delivery_tag: u64,
        redelivered: bool,
        exchange: ShortString,
        routing_key: ShortString,
    },
    BasicGet {
        queue: ShortString,
        no_ack: bool,
    },
    BasicGetOk {
        delivery_tag: u64,
        redelivered: bool,
        exchange: ShortString,
        routing_key: ShortString,
        message_count: u32,
    },
    BasicGetEmpty,
    BasicAck {
        delivery_tag: u64,
        multiple: bool,
    },
    BasicReject {
        delivery_tag: u64,
        requeue: bool,
    },
    BasicNack {
        delivery_tag: u64,
        multiple: bool,
        requeue: bool,
    },
    BasicRecoverOk,
    ConfirmSelect,
    ConfirmSelectOk,
}

/// The arguments of `connection.close` and `channel.close`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Close {
    /// 200 for a normal close, else an AMQP reply code (404, 406, 541 …).
    pub reply_code: u16,
    /// The peer's words.
    pub reply_text: ShortString,
    /// The class of the method that caused it, or 0.
    pub class_id: u16,
    /// The method that caused it, or 0.
    pub method_id: u16,
}

impl Method {
    /// Class and method id.
    pub fn id(&self) -> (u16, u16) {
        use Method::*;
        match self {
            ConnectionStart { .. } => (10, 10),
            ConnectionStartOk { .. } => (10, 11),
            ConnectionSecure { .. } => (10, 20),
            ConnectionSecureOk { .. } => (10, 21),
            ConnectionTune { .. } => (10, 30),
            ConnectionTuneOk { .. } => (10, 31),
            ConnectionOpen { .. } => (10, 40),
            ConnectionOpenOk => (10, 41),
            ConnectionClose(_) => (10, 50),
            ConnectionCloseOk => (10, 51),
            ConnectionBlocked { .. } => (10, 60),
            ConnectionUnblocked => (10, 61),
            ChannelOpen => (20, 10),
            ChannelOpenOk => (20, 11),
            ChannelFlow { .. } => (20, 20),
            ChannelFlowOk { .. } => (20, 21),
            ChannelClose(_) => (20, 40),
            ChannelCloseOk => (20, 41),
            ExchangeDeclare { .. } => (40, 10),
            ExchangeDeclareOk => (40, 11),
            ExchangeDelete { .. } => (40, 20),
            ExchangeDeleteOk => (40, 21),
            ExchangeBind { .. } => (40, 30),
            ExchangeBindOk => (40, 31),
            ExchangeUnbind { .. } => (40, 40),
            ExchangeUnbindOk => (40, 51),
            QueueDeclare { .. } => (50, 10),
            QueueDeclareOk { .. } => (50, 11),
            QueueBind { .. } => (50, 20),
            QueueBindOk => (50, 21),
            QueuePurge { .. } => (50, 30),
            QueuePurgeOk { .. } => (50, 31),
            QueueDelete { .. } => (50, 40),
            QueueDeleteOk { .. } => (50, 41),
            QueueUnbind { .. } => (50, 50),
            QueueUnbindOk => (50, 51),
            BasicQos { .. } => (60, 10),
            BasicQosOk => (60, 11),
            BasicConsume { .. } => (60, 20),
            BasicConsumeOk { .. } => (60, 21),
            BasicCancel { .. } => (60, 30),
            BasicCancelOk { .. } => (60, 31),
            BasicPublish { .. } => (60, 40),
            BasicReturn { .. } => (60, 50),
            BasicDeliver { .. } => (60, 60),
            BasicGet { .. } => (60, 70),
            BasicGetOk { .. } => (60, 71),
            BasicGetEmpty => (60, 72),
            BasicAck { .. } => (60, 80),
            BasicReject { .. } => (60, 90),
            BasicRecoverOk => (60, 111),
            BasicNack { .. } => (60, 120),
            ConfirmSelect => (85, 10),
            ConfirmSelectOk => (85, 11),
        }
    }

    /// True for a method followed by content (header and body frames).
    pub fn has_content(&self) -> bool {
        matches!(
            self,
            Method::BasicPublish { .. }
                | Method::BasicReturn { .. }
                | Method::BasicDeliver { .. }
                | Method::BasicGetOk { .. }
        )
    }

    /// Appends the method frame's payload.
    pub fn encode(&self, out: &mut BytesMut) {
        let (class, method) = self.id();
        out.put_u16(class);
        out.put_u16(method);
        match class {
            10 => self.encode_connection(out),
            20 => self.encode_channel(out),
            40 => self.encode_exchange(out),
            50 => self.encode_queue(out),
            60 => self.encode_basic(out),
            85 => self.encode_confirm(out),
            _ => unreachable!("every method has one of these classes"),
        }
    }

    /// Appends the arguments of a method of class 10 (connection).
    fn encode_connection(&self, out: &mut BytesMut) {
        use Method::*;
        match self {
            ConnectionStart {
                version_major,
                version_minor,
                server_properties,
                mechanisms,
                locales,
            } => {
                out.put_u8(*version_major);
                out.put_u8(*version_minor);
                put_table(out, server_properties);
                put_long_bytes(out, mechanisms.as_bytes());
                put_long_bytes(out, locales.as_bytes());
            }
            ConnectionStartOk {
                client_properties,
                mechanism,
                response,
                locale,
            } => {
                put_table(out, client_properties);
                put_short_string(out, mechanism);
                put_long_bytes(out, response.as_bytes());
                put_short_string(out, locale);
            }
            ConnectionSecure { challenge } => put_long_bytes(out, challenge.as_bytes()),
            ConnectionSecureOk { response } => put_long_bytes(out, response.as_bytes()),
            ConnectionTune {
                channel_max,
                frame_max,
                heartbeat,
            }
            | ConnectionTuneOk {
                channel_max,
                frame_max,
                heartbeat,
            } => {
                out.put_u16(*channel_max);
                out.put_u32(*frame_max);
                out.put_u16(*heartbeat);
            }
            ConnectionOpen { vhost } => {
                put_short_string(out, vhost);
                out.put_u8(0); // reserved-1: capabilities, empty
                out.put_u8(0); // reserved-2: insist
            }
            ConnectionOpenOk => out.put_u8(0),
            ConnectionClose(c) => put_close(out, c),
            ConnectionCloseOk | ConnectionUnblocked => {}
            ConnectionBlocked { reason } => put_short_string(out, reason),
            _ => unreachable!("not a method of class 10"),
        }
    }

    /// Appends the arguments of a method of class 20 (channel).
    fn encode_channel(&self, out: &mut BytesMut) {
        use Method::*;
        match self {
            ChannelOpen => out.put_u8(0),
            ChannelOpenOk => out.put_u32(0),
            ChannelFlow { active } | ChannelFlowOk { active } => bits(out, &[*active]),
            ChannelClose(c) => put_close(out, c),
            ChannelCloseOk => {}
            _ => unreachable!("not a method of class 20"),
        }
    }

    /// Appends the arguments of a method of class 40 (exchange).
    fn encode_exchange(&self, out: &mut BytesMut) {
        use Method::*;
        match self {
            ExchangeDeclare {
                exchange,
                kind,
                passive,
                durable,
                auto_delete,
                internal,
                arguments,
            } => {
                out.put_u16(0);
                put_short_string(out, exchange);
                put_short_string(out, kind);
                bits(out, &[*passive, *durable, *auto_delete, *internal, false]);
                put_table(out, arguments);
            }
            ExchangeDeclareOk | ExchangeDeleteOk | ExchangeBindOk | ExchangeUnbindOk => {}
            ExchangeDelete { exchange, if_unused } => {
                out.put_u16(0);
                put_short_string(out, exchange);
                bits(out, &[*if_unused, false]);
            }
            ExchangeBind {
                destination,
                source,
                routing_key,
                arguments,
            }
            | ExchangeUnbind {
                destination,
                source,
                routing_key,
                arguments,
            } => {
                out.put_u16(0);
                put_short_string(out, destination);
                put_short_string(out, source);
                put_short_string(out, routing_key);
                bits(out, &[false]);
                put_table(out, arguments);
            }
            _ => unreachable!("not a method of class 40"),
        }
    }

    /// Appends the arguments of a method of class 50 (queue).
    fn encode_queue(&self, out: &mut BytesMut) {
        use Method::*;
        match self {
            QueueDeclare {
                queue,
                passive,
                durable,
                exclusive,
                auto_delete,
                arguments,
            } => {
                out.put_u16(0);
                put_short_string(out, queue);
                bits(out, &[*passive, *durable, *exclusive, *auto_delete, false]);
                put_table(out, arguments);
            }
            QueueDeclareOk {
                queue,
                message_count,
                consumer_count,
            } => {
                put_short_string(out, queue);
                out.put_u32(*message_count);
                out.put_u32(*consumer_count);
            }
            QueueBind {
                queue,
                exchange,
                routing_key,
                arguments,
            } => {
                out.put_u16(0);
                put_short_string(out, queue);
                put_short_string(out, exchange);
                put_short_string(out, routing_key);
                bits(out, &[false]);
                put_table(out, arguments);
            }
            QueueUnbind {
                queue,
                exchange,
                routing_key,
                arguments,
            } => {
                out.put_u16(0);
                put_short_string(out, queue);
                put_short_string(out, exchange);
                put_short_string(out, routing_key);
                put_table(out, arguments);
            }
            QueuePurge { queue } => {
                out.put_u16(0);
                put_short_string(out, queue);
                bits(out, &[false]);
            }
            QueuePurgeOk { message_count } | QueueDeleteOk { message_count } => out.put_u32(*message_count),
            QueueDelete {
                queue,
                if_unused,
                if_empty,
            } => {
                out.put_u16(0);
                put_short_string(out, queue);
                bits(out, &[*if_unused, *if_empty, false]);
            }
            QueueBindOk | QueueUnbindOk => {}
            _ => unreachable!("not a method of class 50"),
        }
    }

    /// Appends the arguments of a method of class 60 (basic).
    fn encode_basic(&self, out: &mut BytesMut) {
        use Method::*;
        match self {
            BasicQos { prefetch_count, global } => {
                out.put_u32(0);
                out.put_u16(*prefetch_count);
                bits(out, &[*global]);
            }
            BasicConsume {
                queue,
                consumer_tag,
                no_ack,
                exclusive,
                arguments,
            } => {
                out.put_u16(0);
                put_short_string(out, queue);
                put_short_string(out, consumer_tag);
                bits(out, &[false, *no_ack, *exclusive, false]);
                put_table(out, arguments);
            }
            BasicConsumeOk { consumer_tag } | BasicCancelOk { consumer_tag } => put_short_string(out, consumer_tag),
            BasicCancel { consumer_tag, no_wait } => {
                put_short_string(out, consumer_tag);
                bits(out, &[*no_wait]);
            }
            BasicPublish {
                exchange,
                routing_key,
                mandatory,
            } => {
                out.put_u16(0);
                put_short_string(out, exchange);
                put_short_string(out, routing_key);
                bits(out, &[*mandatory, false]);
            }
            BasicReturn {
                reply_code,
                reply_text,
                exchange,
                routing_key,
            } => {
                out.put_u16(*reply_code);
                put_short_string(out, reply_text);
                put_short_string(out, exchange);
                put_short_string(out, routing_key);
            }
            BasicDeliver {
                consumer_tag,
                delivery_tag,
                redelivered,
                exchange,
                routing_key,
            } => {
                put_short_string(out, consumer_tag);
                out.put_u64(*delivery_tag);
                bits(out, &[*redelivered]);
                put_short_string(out, exchange);
                put_short_string(out, routing_key);
            }
            BasicGet { queue, no_ack } => {
                out.put_u16(0);
                put_short_string(out, queue);
                bits(out, &[*no_ack]);
            }
            BasicGetOk {
                delivery_tag,
                redelivered,
                exchange,
                routing_key,
                message_count,
            } => {
                out.put_u64(*delivery_tag);
                bits(out, &[*redelivered]);
                put_short_string(out, exchange);
                put_short_string(out, routing_key);
                out.put_u32(*message_count);
            }
            BasicAck { delivery_tag, multiple } => {
                out.put_u64(*delivery_tag);
                bits(out, &[*multiple]);
            }
            BasicReject { delivery_tag, requeue } => {
                out.put_u64(*delivery_tag);
                bits(out, &[*requeue]);
            }
            BasicNack {
                delivery_tag,
                multiple,
                requeue,
            } => {
                out.put_u64(*delivery_tag);
                bits(out, &[*multiple, *requeue]);
            }
            BasicQosOk | BasicRecoverOk => {}
            BasicGetEmpty => out.put_u8(0), // reserved-1: cluster-id, empty
            _ => unreachable!("not a method of class 60"),
        }
    }

    /// Appends the arguments of a method of class 85 (confirm).
    fn encode_confirm(&self, out: &mut BytesMut) {
        use Method::*;
        match self {
            ConfirmSelect => bits(out, &[false]),
            ConfirmSelectOk => {}
            _ => unreachable!("not a method of class 85"),
        }
    }

    /// Reads a method frame's payload.
    pub fn decode(payload: &[u8]) -> Result<Method, DecodeError> {
        let mut r = Reader::new(payload);
        let class = r.u16()?;
        let method = r.u16()?;
        let m = match class {
            10 => decode_connection(method, &mut r)?,
            20 => decode_channel(method, &mut r)?,
            40 => decode_exchange(method, &mut r)?,
            50 => decode_queue(method, &mut r)?,
            60 => decode_basic(method, &mut r)?,
            85 => decode_confirm(method, &mut r)?,
            class => return Err(unknown(class, method)),
        };
        Ok(m)
    }
}

fn read_close(r: &mut Reader<'_>) -> Result<Close, DecodeError> {
    Ok(Close {
        reply_code: r.u16()?,
        reply_text: r.short_string()?,
        class_id: r.u16()?,
        method_id: r.u16()?,
    })
}

/// Appends a `connection.close` or `channel.close`.
fn put_close(out: &mut BytesMut, c: &Close) {
    out.put_u16(c.reply_code);
    put_short_string(out, &c.reply_text);
    out.put_u16(c.class_id);
    out.put_u16(c.method_id);
}

/// Packs `flags` into one octet, the first in the lowest bit.
fn bits(out: &mut BytesMut, flags: &[bool]) {
    let mut octet = 0u8;
    for (i, f) in flags.iter().enumerate() {
        if *f {
            octet |= 1 << i;
        }
    }
    out.put_u8(octet);
}

/// The error of a method no class here has.
fn unknown(class: u16, method: u16) -> DecodeError {
    DecodeError::Malformed(format!("unknown method {class}.{method}"))
}

/// Reads a method of class 10 (connection) from `r`.
fn decode_connection(method: u16, r: &mut Reader<'_>) -> Result<Method, DecodeError> {
    use Method::*;
    Ok(match method {
        10 => ConnectionStart {
            version_major: r.u8()?,
            version_minor: r.u8()?,
            server_properties: r.table()?,
            mechanisms: r.long_string()?,
            locales: r.long_string()?,
        },
        11 => ConnectionStartOk {
            client_properties: r.table()?,
            mechanism: r.short_string()?,
            response: r.long_string()?,
            locale: r.short_string()?,
        },
        20 => ConnectionSecure {
            challenge: r.long_string()?,
        },
        21 => ConnectionSecureOk {
            response: r.long_string()?,
        },
        30 => ConnectionTune {
            channel_max: r.u16()?,
            frame_max: r.u32()?,
            heartbeat: r.u16()?,
        },
        31 => ConnectionTuneOk {
            channel_max: r.u16()?,
            frame_max: r.u32()?,
            heartbeat: r.u16()?,
        },
        40 => {
            let vhost = r.short_string()?;
            r.short_string()?;
            r.u8()?;
            ConnectionOpen { vhost }
        }
        41 => {
            r.short_string()?;
            ConnectionOpenOk
        }
        50 => ConnectionClose(read_close(r)?),
        51 => ConnectionCloseOk,
        60 => ConnectionBlocked {
            reason: r.short_string()?,
        },
        61 => ConnectionUnblocked,
        method => return Err(unknown(10, method)),
    })
}

/// Reads a method of class 20 (channel) from `r`.
fn decode_channel(method: u16, r: &mut Reader<'_>) -> Result<Method, DecodeError> {
    use Method::*;
    let bit = |octet: u8, i: u8| octet & (1 << i) != 0;
    Ok(match method {
        10 => {
            r.short_string()?;
            ChannelOpen
        }
        11 => {
            r.long_string()?;
            ChannelOpenOk
        }
        20 => ChannelFlow {
            active: bit(r.u8()?, 0),
        },
        21 => ChannelFlowOk {
            active: bit(r.u8()?, 0),
        },
        40 => ChannelClose(read_close(r)?),
        41 => ChannelCloseOk,
        method => return Err(unknown(20, method)),
    })
}

/// Reads a method of class 40 (exchange) from `r`.
fn decode_exchange(method: u16, r: &mut Reader<'_>) -> Result<Method, DecodeError> {
    use Method::*;
    let bit = |octet: u8, i: u8| octet & (1 << i) != 0;
    Ok(match method {
        10 => {
            r.u16()?;
            let exchange = r.short_string()?;
            let kind = r.short_string()?;
            let b = r.u8()?;
            ExchangeDeclare {
                exchange,
                kind,
                passive: bit(b, 0),
                durable: bit(b, 1),
                auto_delete: bit(b, 2),
                internal: bit(b, 3),
                arguments: r.table()?,
            }
        }
        11 => ExchangeDeclareOk,
        20 => {
            r.u16()?;
            let exchange = r.short_string()?;
            ExchangeDelete {
                exchange,
                if_unused: bit(r.u8()?, 0),
            }
        }
        21 => ExchangeDeleteOk,
        30 | 40 => {
            let bind = method == 30;
            r.u16()?;
            let destination = r.short_string()?;
            let source = r.short_string()?;
            let routing_key = r.short_string()?;
            r.u8()?;
            let arguments = r.table()?;
            if bind {
                ExchangeBind {
                    destination,
                    source,
                    routing_key,
                    arguments,
                }
            } else {
                ExchangeUnbind {
                    destination,
                    source,
                    routing_key,
                    arguments,
                }
            }
        }
        31 => ExchangeBindOk,
        51 => ExchangeUnbindOk,
        method => return Err(unknown(40, method)),
    })
}

/// Reads a method of class 50 (queue) from `r`.
fn decode_queue(method: u16, r: &mut Reader<'_>) -> Result<Method, DecodeError> {
    use Method::*;
    let bit = |octet: u8, i: u8| octet & (1 << i) != 0;
    Ok(match method {
        10 => {
            r.u16()?;
            let queue = r.short_string()?;
            let b = r.u8()?;
            QueueDeclare {
                queue,
                passive: bit(b, 0),
                durable: bit(b, 1),
                exclusive: bit(b, 2),
                auto_delete: bit(b, 3),
                arguments: r.table()?,
            }
        }
        11 => QueueDeclareOk {
            queue: r.short_string()?,
            message_count: r.u32()?,
            consumer_count: r.u32()?,
        },
        20 => {
            r.u16()?;
            let queue = r.short_string()?;
            let exchange = r.short_string()?;
            let routing_key = r.short_string()?;
            r.u8()?;
            QueueBind {
                queue,
                exchange,
                routing_key,
                arguments: r.table()?,
            }
        }
        21 => QueueBindOk,
        30 => {
            r.u16()?;
            let queue = r.short_string()?;
            r.u8()?;
            QueuePurge { queue }
        }
        31 => QueuePurgeOk {
            message_count: r.u32()?,
        },
        40 => {
            r.u16()?;
            let queue = r.short_string()?;
            let b = r.u8()?;
            QueueDelete {
                queue,
                if_unused: bit(b, 0),
                if_empty: bit(b, 1),
            }
        }
        41 => QueueDeleteOk {
            message_count: r.u32()?,
        },
        50 => {
            r.u16()?;
            QueueUnbind {
                queue: r.short_string()?,
                exchange: r.short_string()?,
                routing_key: r.short_string()?,
                arguments: r.table()?,
            }
        }
        51 => QueueUnbindOk,
        method => return Err(unknown(50, method)),
    })
}

/// Reads a method of class 60 (basic) from `r`.
fn decode_basic(method: u16, r: &mut Reader<'_>) -> Result<Method, DecodeError> {
    use Method::*;
    let bit = |octet: u8, i: u8| octet & (1 << i) != 0;
    Ok(match method {
        10 => {
            r.u32()?;
            BasicQos {
                prefetch_count: r.u16()?,
                global: bit(r.u8()?, 0),
            }
        }
        11 => BasicQosOk,
        20 => {
            r.u16()?;
            let queue = r.short_string()?;
            let consumer_tag = r.short_string()?;
            let b = r.u8()?;
            BasicConsume {
                queue,
                consumer_tag,
                no_ack: bit(b, 1),
                exclusive: bit(b, 2),
                arguments: r.table()?,
            }
        }
        21 => BasicConsumeOk {
            consumer_tag: r.short_string()?,
        },
        30 => BasicCancel {
            consumer_tag: r.short_string()?,
            no_wait: bit(r.u8()?, 0),
        },
        31 => BasicCancelOk {
            consumer_tag: r.short_string()?,
        },
        40 => {
            r.u16()?;
            let exchange = r.short_string()?;
            let routing_key = r.short_string()?;
            BasicPublish {
                exchange,
                routing_key,
                mandatory: bit(r.u8()?, 0),
            }
        }
        50 => BasicReturn {
            reply_code: r.u16()?,
            reply_text: r.short_string()?,
            exchange: r.short_string()?,
            routing_key: r.short_string()?,
        },
        60 => BasicDeliver {
            consumer_tag: r.short_string()?,
            delivery_tag: r.u64()?,
            redelivered: bit(r.u8()?, 0),
            exchange: r.short_string()?,
            routing_key: r.short_string()?,
        },
        70 => {
            r.u16()?;
            BasicGet {
                queue: r.short_string()?,
                no_ack: bit(r.u8()?, 0),
            }
        }
        71 => BasicGetOk {
            delivery_tag: r.u64()?,
            redelivered: bit(r.u8()?, 0),
            exchange: r.short_string()?,
            routing_key: r.short_string()?,
            message_count: r.u32()?,
        },
        72 => {
            r.short_string()?;
            BasicGetEmpty
        }
        80 => BasicAck {
            delivery_tag: r.u64()?,
            multiple: bit(r.u8()?, 0),
        },
        90 => BasicReject {
            delivery_tag: r.u64()?,
            requeue: bit(r.u8()?, 0),
        },
        111 => BasicRecoverOk,
        120 => {
            let delivery_tag = r.u64()?;
            let b = r.u8()?;
            BasicNack {
                delivery_tag,
                multiple: bit(b, 0),
                requeue: bit(b, 1),
            }
        }
        method => return Err(unknown(60, method)),
    })
}

/// Reads a method of class 85 (confirm) from `r`.
fn decode_confirm(method: u16, r: &mut Reader<'_>) -> Result<Method, DecodeError> {
    use Method::*;
    Ok(match method {
        10 => {
            r.u8()?;
            ConfirmSelect
        }
        11 => ConfirmSelectOk,
        method => return Err(unknown(85, method)),
    })
}

/// A short string from a name the caller passed, or the error saying it is too long.
pub fn short(name: &str) -> Result<ShortString, TooLong> {
    ShortString::try_from(name)
}

/// Appends a basic.publish method frame for `exchange` and `routing_key` without building a
/// [`Method`] (the hot path).
pub fn put_publish(out: &mut BytesMut, exchange: &[u8], routing_key: &[u8], mandatory: bool) -> Result<(), TooLong> {
    out.put_u16(60);
    out.put_u16(40);
    out.put_u16(0);
    put_short_bytes(out, exchange)?;
    put_short_bytes(out, routing_key)?;
    out.put_u8(u8::from(mandatory));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::FieldValue;

    fn s(text: &str) -> ShortString {
        ShortString::try_from(text).unwrap()
    }

    #[test]
    fn every_method_round_trips() {
        let mut args = FieldTable::new();
        args.insert(s("x-queue-type"), FieldValue::string("quorum"));
        let close = Close {
            reply_code: 406,
            reply_text: s("PRECONDITION_FAILED"),
            class_id: 50,
            method_id: 10,
        };
        let all = vec![
            Method::ConnectionStart {
                version_major: 0,
                version_minor: 9,
                server_properties: args.clone(),
                mechanisms: "PLAIN AMQPLAIN".into(),
                locales: "en_US".into(),
            },
            Method::ConnectionStartOk {
                client_properties: args.clone(),
                mechanism: s("PLAIN"),
                response: "\0guest\0guest".into(),
                locale: s("en_US"),
            },
            Method::ConnectionSecure { challenge: "c".into() },
            Method::ConnectionSecureOk { response: "r".into() },
            Method::ConnectionTune {
                channel_max: 2047,
                frame_max: 131072,
                heartbeat: 60,
            },
            Method::ConnectionTuneOk {
                channel_max: 2047,
                frame_max: 131072,
                heartbeat: 10,
            },
            Method::ConnectionOpen { vhost: s("/") },
            Method::ConnectionOpenOk,
            Method::ConnectionClose(close.clone()),
            Method::ConnectionCloseOk,
            Method::ConnectionBlocked {
                reason: s("low on memory"),
            },
            Method::ConnectionUnblocked,
            Method::ChannelOpen,
            Method::ChannelOpenOk,
            Method::ChannelFlow { active: true },
            Method::ChannelFlowOk { active: false },
            Method::ChannelClose(close),
            Method::ChannelCloseOk,
            Method::ExchangeDeclare {
                exchange: s("e"),
                kind: s("fanout"),
                passive: false,
                durable: true,
                auto_delete: false,
                internal: true,
                arguments: args.clone(),
            },
            Method::ExchangeDeclareOk,
            Method::ExchangeDelete {
                exchange: s("e"),
                if_unused: true,
            },
            Method::ExchangeDeleteOk,
            Method::ExchangeBind {
                destination: s("d"),
                source: s("e"),
                routing_key: s("k"),
                arguments: args.clone(),
            },
            Method::ExchangeBindOk,
            Method::ExchangeUnbind {
                destination: s("d"),
                source: s("e"),
                routing_key: s("k"),
                arguments: args.clone(),
            },
            Method::ExchangeUnbindOk,
            Method::QueueDeclare {
                queue: s("q"),
                passive: true,
                durable: true,
                exclusive: false,
                auto_delete: true,
                arguments: args.clone(),
            },
            Method::QueueDeclareOk {
                queue: s("q"),
                message_count: 5,
                consumer_count: 1,
            },
            Method::QueueBind {
                queue: s("q"),
                exchange: s("e"),
                routing_key: s("k"),
                arguments: args.clone(),
            },
            Method::QueueBindOk,
            Method::QueueUnbind {
                queue: s("q"),
                exchange: s("e"),
                routing_key: s("k"),
                arguments: args.clone(),
            },
            Method::QueueUnbindOk,
            Method::QueuePurge { queue: s("q") },
            Method::QueuePurgeOk { message_count: 3 },
            Method::QueueDelete {
                queue: s("q"),
                if_unused: false,
                if_empty: true,
            },
            Method::QueueDeleteOk { message_count: 2 },
            Method::BasicQos {
                prefetch_count: 200,
                global: false,
            },
            Method::BasicQosOk,
            Method::BasicConsume {
                queue: s("q"),
                consumer_tag: s(""),
                no_ack: false,
                exclusive: true,
                arguments: args,
            },
            Method::BasicConsumeOk {
                consumer_tag: s("ctag"),
            },
            Method::BasicCancel {
                consumer_tag: s("ctag"),
                no_wait: true,
            },
            Method::BasicCancelOk {
                consumer_tag: s("ctag"),
            },
            Method::BasicPublish {
                exchange: s(""),
                routing_key: s("orders"),
                mandatory: true,
            },
            Method::BasicReturn {
                reply_code: 312,
                reply_text: s("NO_ROUTE"),
                exchange: s(""),
                routing_key: s("gone"),
            },
            Method::BasicDeliver {
                consumer_tag: s("ctag"),
                delivery_tag: u64::MAX,
                redelivered: true,
                exchange: ShortString::new(&b"\xff"[..]).unwrap(),
                routing_key: s("k"),
            },
            Method::BasicGet {
                queue: s("q"),
                no_ack: true,
            },
            Method::BasicGetOk {
                delivery_tag: 1,
                redelivered: false,
                exchange: s("e"),
                routing_key: s("k"),
                message_count: 9,
            },
            Method::BasicGetEmpty,
            Method::BasicAck {
                delivery_tag: 7,
                multiple: true,
            },
            Method::BasicReject {
                delivery_tag: 7,
                requeue: true,
            },
            Method::BasicNack {
                delivery_tag: 7,
                multiple: false,
                requeue: true,
            },
            Method::BasicRecoverOk,
            Method::ConfirmSelect,
            Method::ConfirmSelectOk,
        ];
        for m in all {
            let mut out = BytesMut::new();
            m.encode(&mut out);
            assert_eq!(Method::decode(&out), Ok(m.clone()), "{m:?}");
        }
    }

    #[test]
    fn the_hot_path_publish_matches_the_method() {
        let mut a = BytesMut::new();
        put_publish(&mut a, b"", b"orders", true).unwrap();
        let mut b = BytesMut::new();
        Method::BasicPublish {
            exchange: s(""),
            routing_key: s("orders"),
            mandatory: true,
        }
        .encode(&mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn unknown_methods_and_truncation_are_errors() {
        assert!(Method::decode(&[0, 99, 0, 1]).is_err());
        assert!(Method::decode(&[0, 60, 0, 60, 3]).is_err());
        assert!(Method::decode(&[]).is_err());
    }
}
