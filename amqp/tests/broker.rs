//! The client against a real RabbitMQ (`LADDER_TEST_AMQP_URL`, default the machine's broker on
//! 127.0.0.1:5672). Each test uses queues named after itself and deletes them.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ladder_amqp::{
    BasicProperties, Channel, Confirmation, ConnectOptions, Connection, Decimal, Error, FieldTable, FieldValue,
    QueueOptions, ShortString,
};
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(20);

fn url() -> String {
    std::env::var("LADDER_TEST_AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

async fn connect() -> Connection {
    let mut options = ConnectOptions::new(url().parse().unwrap());
    options.connection_name = Some("ladder-amqp-test".into());
    timeout(WAIT, Connection::connect(&options)).await.unwrap().unwrap()
}

fn unique(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("lt-amqp-{name}-{}-{nanos}", std::process::id())
}

async fn queue(ch: &Channel, name: &str) {
    let options = QueueOptions {
        durable: false,
        auto_delete: false,
        ..Default::default()
    };
    timeout(WAIT, ch.queue_declare(name, options, FieldTable::new()))
        .await
        .unwrap()
        .unwrap();
}

fn s(bytes: &[u8]) -> ShortString {
    ShortString::new(bytes).unwrap()
}

async fn next(consumer: &mut ladder_amqp::Consumer) -> ladder_amqp::Delivery {
    timeout(WAIT, consumer.next())
        .await
        .expect("a delivery in time")
        .unwrap()
        .unwrap()
}

#[tokio::test]
async fn every_property_and_header_type_arrives_byte_exact_even_when_not_utf8() {
    let conn = connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select().await.unwrap();
    let q = unique("exact");
    queue(&ch, &q).await;

    let mut nested = FieldTable::new();
    nested.insert(s(b"k\xfe"), FieldValue::LongString(vec![0xff, 0x00].into()));
    let mut headers = FieldTable::new();
    for (k, v) in [
        (&b"bool"[..], FieldValue::Boolean(true)),
        (b"i8", FieldValue::ShortShortInt(-1)),
        (b"u8", FieldValue::ShortShortUInt(255)),
        (b"i16", FieldValue::ShortInt(-2)),
        (b"u16", FieldValue::ShortUInt(65535)),
        (b"i32", FieldValue::LongInt(-3)),
        (b"u32", FieldValue::LongUInt(4_000_000_000)),
        (b"i64", FieldValue::LongLongInt(-4)),
        (b"f32", FieldValue::Float(1.5)),
        (b"f64", FieldValue::Double(2.5)),
        (b"dec", FieldValue::Decimal(Decimal { scale: 2, value: 1999 })),
        (b"str", FieldValue::string("text")),
        (
            b"arr",
            FieldValue::FieldArray(vec![FieldValue::LongInt(1), FieldValue::Void]),
        ),
        (b"ts", FieldValue::Timestamp(1_700_000_000)),
        (b"tab", FieldValue::FieldTable(nested)),
        (b"void", FieldValue::Void),
        (b"bytes", FieldValue::ByteArray(vec![0, 1, 0xff])),
        (b"name\xff\xfe", FieldValue::string("a header name that is not UTF-8")),
    ] {
        headers.insert(s(k), v);
    }
    let props = BasicProperties {
        content_type: Some(s(b"application/x\xff")),
        headers: Some(headers),
        delivery_mode: Some(2),
        priority: Some(3),
        correlation_id: Some(s(b"corr\xc3\x28")),
        message_id: Some(s(b"\xff\xfe\xfd not utf-8")),
        timestamp: Some(1_700_000_000),
        kind: Some(s(b"t\x80")),
        app_id: Some(s(b"app")),
        ..Default::default()
    };
    let body = b"\x00\x01binary\xff".to_vec();
    let confirm = ch.basic_publish("", &q, true, &props, &body).unwrap();
    assert_eq!(timeout(WAIT, confirm).await.unwrap().unwrap(), Confirmation::Ack);

    let reader = conn.create_channel().await.unwrap();
    reader.basic_qos(10).await.unwrap();
    let mut consumer = reader.basic_consume(&q, "", false, FieldTable::new()).await.unwrap();
    let d = next(&mut consumer).await;
    assert_eq!(d.properties, props);
    assert_eq!(d.body, body);
    assert!(d.undecodable.is_none());
    reader.basic_ack(d.delivery_tag, false).unwrap();
    ch.queue_delete(&q).await.unwrap();
    assert!(conn.is_open(), "odd bytes must not cost the connection");
}

#[tokio::test]
async fn a_routing_key_that_is_not_utf8_routes_and_arrives_as_sent() {
    let conn = connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select().await.unwrap();
    let q = unique("rk");
    let x = unique("rk-x");
    queue(&ch, &q).await;
    ch.exchange_declare(&x, "fanout", false, FieldTable::new())
        .await
        .unwrap();
    ch.queue_bind(&q, &x, "", FieldTable::new()).await.unwrap();
    let key = b"key\xff\xfe";
    let confirm = ch
        .basic_publish(x.as_bytes(), &key[..], true, &BasicProperties::default(), b"x")
        .unwrap();
    assert_eq!(timeout(WAIT, confirm).await.unwrap().unwrap(), Confirmation::Ack);
    let reader = conn.create_channel().await.unwrap();
    reader.basic_qos(1).await.unwrap();
    let mut consumer = reader.basic_consume(&q, "", false, FieldTable::new()).await.unwrap();
    let d = next(&mut consumer).await;
    assert_eq!(d.routing_key.as_bytes(), key);
    ch.queue_delete(&q).await.unwrap();
    ch.exchange_delete(&x).await.unwrap();
}

/// `skip_header_keys_unless_routed`: the skipped headers are stepped over on every delivery but
/// those whose routing key begins with the prefix, which arrive with every header.
#[tokio::test]
async fn skipped_headers_are_kept_on_deliveries_routed_with_the_prefix() {
    let conn = connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select().await.unwrap();
    let q = unique("skip");
    let x = unique("skip-x");
    queue(&ch, &q).await;
    ch.exchange_declare(&x, "fanout", false, FieldTable::new())
        .await
        .unwrap();
    ch.queue_bind(&q, &x, "", FieldTable::new()).await.unwrap();
    let mut headers = FieldTable::new();
    headers.set("x-death", FieldValue::LongString(b"annotation".to_vec().into()));
    headers.set("kept", FieldValue::LongInt(1));
    let props = BasicProperties::default().with_headers(headers);
    for key in ["wait.1s", "1s", "await.1s"] {
        let confirm = ch
            .basic_publish(x.as_bytes(), key.as_bytes(), true, &props, b"x")
            .unwrap();
        assert_eq!(timeout(WAIT, confirm).await.unwrap().unwrap(), Confirmation::Ack);
    }
    let reader = conn.create_channel().await.unwrap();
    reader.skip_header_keys_unless_routed(&["x-death"], "wait.");
    let mut consumer = reader.basic_consume(&q, "", true, FieldTable::new()).await.unwrap();
    for (key, kept) in [("wait.1s", true), ("1s", false), ("await.1s", false)] {
        let d = next(&mut consumer).await;
        assert_eq!(d.routing_key.as_bytes(), key.as_bytes());
        let h = d.properties.headers.as_ref().unwrap();
        assert_eq!(h.get("x-death").is_some(), kept, "{key}");
        assert_eq!(
            h.get("kept"),
            Some(&FieldValue::LongInt(1)),
            "{key}: the others always arrive"
        );
    }
    ch.queue_delete(&q).await.unwrap();
    ch.exchange_delete(&x).await.unwrap();
}

/// Regression: a return was handed to whichever publish's confirm completed next (lapin
/// 4.12.3), so with many mandatory publishes in flight some missing-queue publishes looked
/// delivered and some delivered ones looked returned.
#[tokio::test]
async fn returns_land_on_their_own_publish_with_thousands_in_flight() {
    let conn = connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select().await.unwrap();
    let q = unique("present");
    // a quorum queue confirms after replication, so acks come late and cover many publishes
    let mut args = FieldTable::new();
    args.set("x-queue-type", FieldValue::string("quorum"));
    let durable = QueueOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(&q, durable, args).await.unwrap();
    let missing = unique("missing");
    let mut present = 0;
    for run in 0..5 {
        let mut confirms = Vec::new();
        for i in 0..2000u32 {
            // irregular mix, so acks with `multiple` cover both kinds
            let to_missing = (i * 7 + run) % 3 == 0;
            let target = if to_missing { &missing } else { &q };
            present += u32::from(!to_missing);
            let props = BasicProperties {
                message_id: Some(ShortString::try_from(format!("{run}-{i}")).unwrap()),
                ..Default::default()
            };
            let body = format!("{run}-{i}");
            confirms.push((
                to_missing,
                ch.basic_publish("", target, true, &props, body.as_bytes()).unwrap(),
            ));
        }
        let mut wrong = Vec::new();
        for (i, (to_missing, confirm)) in confirms.into_iter().enumerate() {
            let got = timeout(WAIT, confirm).await.unwrap().unwrap();
            let ok = match (&got, to_missing) {
                (Confirmation::Returned(r), true) => r.routing_key == missing.as_str() && r.reply_code == 312,
                (Confirmation::Ack, false) => true,
                _ => false,
            };
            if !ok {
                wrong.push((i, got));
            }
        }
        assert!(
            wrong.is_empty(),
            "run {run}: {} misattributed, e.g. {:?}",
            wrong.len(),
            &wrong[..wrong.len().min(3)]
        );
    }
    let purged = ch.queue_delete(&q).await.unwrap();
    assert_eq!(purged, present, "exactly the present-queue publishes arrived");
}

#[tokio::test]
async fn a_failed_call_closes_only_its_channel() {
    let conn = connect().await;
    let ch = conn.create_channel().await.unwrap();
    let err = timeout(WAIT, ch.queue_inspect(&unique("absent")))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.reply_code(), Some(404), "{err}");
    assert!(!ch.is_open());
    assert!(ch.basic_ack(1, false).is_err());
    let again = conn.create_channel().await.unwrap();
    let q = unique("after");
    queue(&again, &q).await;
    assert_eq!(again.queue_inspect(&q).await.unwrap().message_count, 0);
    again.queue_delete(&q).await.unwrap();
}

#[tokio::test]
async fn a_deleted_queue_ends_its_consumer_and_bodies_of_any_size_arrive_whole() {
    let conn = connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select().await.unwrap();
    let q = unique("sizes");
    queue(&ch, &q).await;
    let frame = conn.frame_max();
    let sizes = [0, 1, frame - 9, frame - 8, frame - 7, frame * 3 + 5, 5 << 20];
    for size in sizes {
        let body: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let c = ch
            .basic_publish("", &q, true, &BasicProperties::default(), &body)
            .unwrap();
        assert_eq!(timeout(WAIT, c).await.unwrap().unwrap(), Confirmation::Ack);
    }
    let reader = conn.create_channel().await.unwrap();
    reader.basic_qos(2).await.unwrap();
    let mut consumer = reader.basic_consume(&q, "", false, FieldTable::new()).await.unwrap();
    for size in sizes {
        let d = next(&mut consumer).await;
        assert_eq!(d.body.len(), size);
        assert!(d.body.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
        reader.basic_ack(d.delivery_tag, false).unwrap();
    }
    ch.queue_delete(&q).await.unwrap();
    let end = timeout(WAIT, consumer.next()).await.unwrap();
    assert!(end.is_none(), "the broker's cancel ends the stream: {end:?}");
}

#[tokio::test]
async fn headers_nested_beyond_the_decoder_limit_arrive_as_bytes_and_republish_unchanged() {
    let conn = connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select().await.unwrap();
    let q = unique("deep");
    queue(&ch, &q).await;
    let mut deep = FieldValue::LongInt(7);
    for _ in 0..ladder_amqp::types::MAX_DEPTH + 10 {
        deep = FieldValue::FieldArray(vec![deep]);
    }
    let mut headers = FieldTable::new();
    headers.set("deep", deep);
    let props = BasicProperties {
        message_id: Some(s(b"m")),
        headers: Some(headers),
        ..Default::default()
    };
    let c = ch.basic_publish("", &q, true, &props, b"body").unwrap();
    assert_eq!(timeout(WAIT, c).await.unwrap().unwrap(), Confirmation::Ack);
    let reader = conn.create_channel().await.unwrap();
    reader.basic_qos(1).await.unwrap();
    let mut consumer = reader.basic_consume(&q, "", false, FieldTable::new()).await.unwrap();
    let d = next(&mut consumer).await;
    let raw = d.undecodable.clone().expect("kept as bytes");
    assert_eq!(raw.error, ladder_amqp::types::DecodeError::TooDeep);
    let lossy = raw.lossy.clone().expect("the shallow part decodes");
    assert_eq!(lossy.message_id, props.message_id);
    assert_eq!(d.body, b"body");
    // publish the bytes again: the copy is identical
    let c = ch
        .basic_publish_raw(b"", q.as_bytes(), true, &raw.bytes, &d.body)
        .unwrap();
    assert_eq!(timeout(WAIT, c).await.unwrap().unwrap(), Confirmation::Ack);
    reader.basic_ack(d.delivery_tag, false).unwrap();
    let copy = next(&mut consumer).await;
    assert_eq!(copy.undecodable.unwrap().bytes, raw.bytes);
    reader.basic_ack(copy.delivery_tag, false).unwrap();
    assert!(conn.is_open());
    ch.queue_delete(&q).await.unwrap();
}

#[tokio::test]
async fn a_wrong_password_is_an_auth_error_and_the_version_is_read() {
    let mut uri: ladder_amqp::AmqpUri = url().parse().unwrap();
    uri.password = "not-the-password".into();
    let err = timeout(WAIT, Connection::connect(&ConnectOptions::new(uri)))
        .await
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, Error::Auth(_)), "{err}");
    let conn = connect().await;
    let (major, _, _) = conn.server_version().expect("a version");
    assert!(major >= 3);
}

#[tokio::test]
async fn many_channels_publish_and_consume_at_once_without_losing_a_message() {
    let conn = connect().await;
    let q = unique("many");
    let setup = conn.create_channel().await.unwrap();
    queue(&setup, &q).await;
    let mut tasks = Vec::new();
    for t in 0..8 {
        let conn = conn.clone();
        let q = q.clone();
        tasks.push(tokio::spawn(async move {
            let ch = conn.create_channel().await.unwrap();
            ch.confirm_select().await.unwrap();
            let mut confirms = Vec::new();
            for i in 0..500 {
                let body = format!("{t}-{i}");
                confirms.push(
                    ch.basic_publish("", &q, true, &BasicProperties::default(), body.as_bytes())
                        .unwrap(),
                );
            }
            for c in confirms {
                assert_eq!(timeout(WAIT, c).await.unwrap().unwrap(), Confirmation::Ack);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let reader = conn.create_channel().await.unwrap();
    reader.basic_qos(100).await.unwrap();
    let mut consumer = reader.basic_consume(&q, "", false, FieldTable::new()).await.unwrap();
    let mut seen = HashSet::new();
    while seen.len() < 4000 {
        let d = next(&mut consumer).await;
        reader.basic_ack(d.delivery_tag, false).unwrap();
        assert!(seen.insert(d.body), "no duplicates");
    }
    setup.queue_delete(&q).await.unwrap();
}

/// A TCP hop between the client and the broker that can be frozen: frozen, it passes no more
/// bytes either way and keeps both sockets open — what the client sees of a lost machine or a
/// network partition, with a real broker on the far side.
struct Freezer {
    port: u16,
    frozen: Arc<AtomicBool>,
}

impl Freezer {
    /// Listens on a port of its own and forwards its one connection to the broker of `url()`.
    async fn start() -> Freezer {
        let uri: ladder_amqp::AmqpUri = url().parse().unwrap();
        let broker = (uri.host.clone(), uri.port);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let frozen = Arc::new(AtomicBool::new(false));
        let pass = |mut from: tokio::net::tcp::OwnedReadHalf,
                    mut to: tokio::net::tcp::OwnedWriteHalf,
                    frozen: Arc<AtomicBool>| async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match from.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if frozen.load(Ordering::SeqCst) {
                    // hold both sockets open, pass nothing, for as long as the test runs
                    std::future::pending::<()>().await;
                }
                if to.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        };
        let hop = frozen.clone();
        tokio::spawn(async move {
            let (client, _) = listener.accept().await.unwrap();
            let upstream = tokio::net::TcpStream::connect(broker).await.unwrap();
            let (client_read, client_write) = client.into_split();
            let (upstream_read, upstream_write) = upstream.into_split();
            tokio::spawn(pass(client_read, upstream_write, hop.clone()));
            tokio::spawn(pass(upstream_read, client_write, hop));
        });
        Freezer { port, frozen }
    }

    /// A client through the hop, asking for a heartbeat every second.
    async fn connect(&self) -> Connection {
        let mut uri: ladder_amqp::AmqpUri = url().parse().unwrap();
        uri.host = "127.0.0.1".into();
        uri.port = self.port;
        uri.heartbeat = Some(1);
        timeout(WAIT, Connection::connect(&ConnectOptions::new(uri)))
            .await
            .unwrap()
            .unwrap()
    }

    fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }
}

#[tokio::test]
async fn a_broker_gone_silent_fails_the_connection_within_two_heartbeats_and_an_idle_one_stays_open() {
    let freezer = Freezer::start().await;
    let conn = freezer.connect().await;
    assert_eq!(conn.heartbeat(), Some(Duration::from_secs(1)));
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select().await.unwrap();
    // idle for three silence limits: the broker's heartbeats alone keep it open, and it works
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(conn.is_open(), "an idle connection with heartbeats flowing stays open");
    let q = unique("silent");
    queue(&ch, &q).await;
    let confirm = timeout(
        WAIT,
        ch.basic_publish("", &q, true, &BasicProperties::default(), b"x")
            .unwrap(),
    )
    .await
    .unwrap()
    .unwrap();
    assert!(matches!(confirm, Confirmation::Ack), "{confirm:?}");
    ch.queue_delete(&q).await.unwrap();

    // silence from here on: no heartbeat, no close, the socket stays open
    freezer.freeze();
    let frozen_at = std::time::Instant::now();
    let error = timeout(WAIT, conn.closed()).await.expect("the silence is noticed");
    let waited = frozen_at.elapsed();
    assert!(matches!(error, Error::HeartbeatTimeout(2)), "{error}");
    // two heartbeat intervals after the last bytes read, which came at most one interval before
    // the freeze (the broker's heartbeats), plus the timer's and a busy machine's slack
    assert!(waited <= Duration::from_millis(3_500), "noticed after {waited:?}");
    assert!(!conn.is_open());
    assert!(
        ch.basic_publish("", "anywhere", false, &BasicProperties::default(), b"x")
            .is_err()
    );
}
