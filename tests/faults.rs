//! Fault tests on a three-node RabbitMQ cluster: under a steady, confirmed load, kill the node
//! leading the ladder's queues, kill the node Ladder is connected to, close Ladder's
//! connections, SIGKILL Ladder, restart every node in turn — with one and with two replicas.
//! Each asserts that nothing is lost (every confirmed message is delivered or parked), counts
//! duplicates against a stated bound, and checks that the service recovers by itself within a
//! bound. Each prints one `FAULT …` line with its numbers (the README's fault table).
//!
//! Run them with `scripts/faults` (`--full` for all of them): it brings the cluster up
//! (`scripts/broker up 4.3-cluster`), sets `LADDER_TEST_CLUSTER_URLS` and runs this binary alone,
//! one test at a time. Without `LADDER_TEST_CLUSTER_URLS` every test skips (they disturb
//! brokers and must not run beside other tests); with it, the node-kill and connection-kill
//! cases with one replica run (CI, ~30 s each), and the rest only with `LADDER_FAULTS_FULL=1`.
//! Tests wait for each other, across processes too (a listener on 127.0.0.1:29711 marks a
//! running one): two runs at once would kill each other's nodes.
//! `LADDER_FAULTS_RUST_LOG` sets the services' `RUST_LOG` (default `ladder=debug`); their logs
//! and an `arrivals.csv` of every delivery are kept under `target/tmp/faults/<namespace>/` when
//! a test fails (always with `LADDER_FAULTS_KEEP=1`).
//!
//! The partition cases (`fault_partition_*`) need the nodes in network namespaces of their own
//! (`scripts/broker` profile `4.3-netns`; `scripts/faults --full` runs them there, see
//! `scripts/broker.md`) and skip on any other profile: Ladder cut off from its node (blackhole
//! routes both ways between this machine's namespace and the node's), the node leading the
//! ladder's queues — Ladder's node too — cut off from the other two (a minority leader), the
//! same one way only (what the leader sends to the others is dropped), and the leader's link
//! set down and up every 3 s for a minute. Each heals, and prints its `FAULT …` line with how
//! long the service took to leave the node (`detected_ms`).
//!
//! The setup of every scenario: the topology is declared through node 2 and the destination
//! queue (quorum) is declared there too, so node 2 leads them all (RabbitMQ places a new
//! queue's leader on the node the client is connected to); replica 1 connects to node 1 first,
//! replica 2 to node 3; the test's producer and followers to node 3. So killing the leader node
//! and killing Ladder's node are separate faults; the rolling restart hits every role.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::cluster::{
    Arrival, CLUSTER_URLS_VAR, Cluster, ExclusiveUse, Follower, LadderProcess, PARTITION_PROFILE, Producer,
    ProducerReport, PropsFor, connect_any, delete_on_cluster_blocking, lock,
};
use common::{WAIT, declared_names, now_ms, unique_namespace};
use ladder::broker::topology::Names;
use ladder_amqp::{BasicProperties, FieldTable, FieldValue, QueueOptions};
use tokio_util::sync::CancellationToken;

/// Unacked deliveries per consumer of each replica: what a lost connection can leave to be
/// redelivered, so the unit of the duplicate bound.
const PREFETCH: u64 = 50;

/// Failures published per second, for the whole scenario.
const RATE: f64 = 150.0;

/// The node the topology and the destination are declared through (so it leads them).
const LEAD_NODE: usize = 2;

/// The node each replica connects to first.
const REPLICA_NODES: [usize; 2] = [1, 3];

/// The node the test's own clients connect to first.
const CLIENT_NODE: usize = 3;

/// Load before the fault.
const WARMUP: Duration = Duration::from_secs(3);

/// How long a killed node stays down before it is started again (`LADDER_FAULTS_NODE_DOWN_MS`
/// overrides it, to see what a longer outage costs).
fn node_down() -> Duration {
    let ms = std::env::var("LADDER_FAULTS_NODE_DOWN_MS")
        .ok()
        .and_then(|v| v.parse().ok());
    Duration::from_millis(ms.unwrap_or(3000))
}

/// Retries sent into the delay levels before a rolling upgrade, and their `retry-delay`: long
/// enough to come due while the nodes go through the upgrade (about 30 s a node here).
const LEVELLED: usize = 20;
const LEVELLED_DELAY: Duration = Duration::from_secs(60);

/// Load after the fault (after the killed node is back).
const AFTER: Duration = Duration::from_secs(5);

/// The ladder: two short tiers, three attempts.
const LADDER: &str = r#"
backoff = ["200ms", "1s"]
max_attempts = 3
allow = ["^{ns}-"]
"#;

/// The faults, one test each, with one and with two replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// SIGKILL the node leading the tier queues (and intake, due, parked, destination), then
    /// start it again.
    LeaderNode,
    /// SIGKILL the node replica 1 is connected to, then start it again.
    LadderNode,
    /// `rabbitmqctl close_connection` on every connection of every replica.
    CloseConnections,
    /// SIGKILL replica 1; with one replica, start it again at once.
    KillLadder,
    /// Stop, start (and wait until it serves) each node in turn.
    RollingRestart,
    /// RabbitMQ's rolling-upgrade procedure on each node in turn (`scripts/broker upgrade`:
    /// await_online_quorum_plus_one, drain, stop, start from the target version's root on the
    /// same data, revive), to `LADDER_FAULTS_UPGRADE_TO` (default: the version the cluster runs,
    /// the procedure alone). Meant for the `4.0-cluster` profile.
    RollingUpgrade,
    /// Blackhole routes between this machine (Ladder, the test's clients) and the node replica
    /// 1 is connected to, both ways, for [`partition_for`]; then healed.
    PartitionLadder,
    /// The node leading the ladder's queues, which replica 1 is connected to, cut off from the
    /// other two (both ways) for [`partition_for`]: a minority leader. This machine still reaches it.
    PartitionLeader,
    /// Like [`Fault::PartitionLeader`], one way: what the leader sends to the other two nodes is
    /// dropped, what they send to it arrives.
    PartitionOneWay,
    /// The leader's link (replica 1's node) down and up every [`FLAP_HALF`] for [`FLAP_FOR`].
    PartitionFlap,
}

/// How long a partition lasts: 20 s, or `LADDER_FAULTS_PARTITION_SECS`.
fn partition_for() -> Duration {
    let secs = std::env::var("LADDER_FAULTS_PARTITION_SECS")
        .ok()
        .and_then(|s| s.parse().ok());
    Duration::from_secs(secs.unwrap_or(20))
}

/// A flapping link is down this long, then up this long.
const FLAP_HALF: Duration = Duration::from_secs(3);

/// For how long the link flaps.
const FLAP_FOR: Duration = Duration::from_secs(60);

/// Issue 39's target: what came due during a partition has arrived within 10 s of the heal.
const DRAIN_BOUND: Duration = Duration::from_secs(10);

/// Issue 48's target: ready within 5 s of a partition's heal, whatever the nodes' `net_ticktime`
/// (a new session looks its exchanges up instead of declaring them, which would wait for the
/// metadata store's leader).
const READY_AFTER_HEAL: Duration = Duration::from_secs(5);

/// Issue 39's target: a silent cut, or a node that cannot reach the queues' leaders, is left
/// within 5 s (`amqp.heartbeat_timeout` and `amqp.stall_timeout`, 3 s by default, plus one
/// look of the watchdog and the reconnect); a second of slack for a loaded two-core machine.
const DETECTION_BOUND: Duration = Duration::from_secs(6);

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::LeaderNode => "leader-node-killed",
            Fault::LadderNode => "ladder-node-killed",
            Fault::CloseConnections => "connections-closed",
            Fault::KillLadder => "ladder-killed",
            Fault::RollingRestart => "rolling-restart",
            Fault::RollingUpgrade => "rolling-upgrade",
            Fault::PartitionLadder => "partition-ladder-cut-off",
            Fault::PartitionLeader => "partition-minority-leader",
            Fault::PartitionOneWay => "partition-one-way",
            Fault::PartitionFlap => "partition-flapping-link",
        }
    }

    /// A partition: needs the `4.3-netns` profile.
    fn partition(self) -> bool {
        matches!(
            self,
            Fault::PartitionLadder | Fault::PartitionLeader | Fault::PartitionOneWay | Fault::PartitionFlap
        )
    }

    /// The node each replica connects to first: for a cut of the leader, replica 1 sits on the
    /// leader, the worst place.
    fn replica_nodes(self) -> [usize; 2] {
        match self {
            Fault::PartitionLeader | Fault::PartitionOneWay | Fault::PartitionFlap => [LEAD_NODE, CLIENT_NODE],
            _ => REPLICA_NODES,
        }
    }

    /// Longest time without a delivery to the destination, from the fault on. Measured in
    /// runs here: see the report of each test.
    fn recovery_bound(self) -> Duration {
        match self {
            Fault::CloseConnections => Duration::from_secs(5),
            Fault::RollingRestart | Fault::RollingUpgrade => Duration::from_secs(20),
            // Ladder leaves the minority node within 5 s, but a session on the majority needs
            // the topology declared (a metadata write) and the ladder's streams read to a marker
            // of its own (an append), and with the streams' writers and the metadata on the
            // minority node those wait until the majority's nodes notice the cut (net_ticktime,
            // 10 s on 4.3-netns) or the heal: measured 10-20.5 s for a 20 s cut, so issue 39's
            // 5 s is not met here (docs/src/operations/faults.md#partitions)
            Fault::PartitionLeader | Fault::PartitionOneWay => partition_for() + Duration::from_secs(5),
            _ => Duration::from_secs(10),
        }
    }

    /// Largest lateness of a delivery against its `retry-due-at`, for a fault that lasted
    /// `fault`. When the node Ladder is connected to dies, the quorum queues (led elsewhere)
    /// keep what they had delivered to it (up to the prefetch per consumer) until that node is
    /// back, as they cannot tell a dead consumer from a partitioned one: those messages are
    /// late by the node's downtime. Otherwise in-flight messages return at once.
    /// A queue whose leader's node goes away takes nothing in and lets nothing expire until
    /// its members elect another leader: measured up to 5.1 s in a rolling restart (the tier's
    /// two remaining members, one just restarted and behind, split their votes for 5 terms).
    fn lateness_bound(self, fault: Duration) -> Duration {
        match self {
            Fault::LadderNode => fault + Duration::from_secs(5),
            Fault::LeaderNode | Fault::RollingRestart | Fault::RollingUpgrade => Duration::from_secs(10),
            Fault::CloseConnections | Fault::KillLadder => Duration::from_secs(5),
            // issue 39's target is the cut plus 5 s: what the lost session held returns to its
            // queue once its node hears of the loss (the node's own heartbeat timeout), or, held
            // on the minority side, at the heal
            Fault::PartitionLadder | Fault::PartitionLeader | Fault::PartitionOneWay => fault + Duration::from_secs(5),
            // each cut of a flapping link lasts FLAP_HALF
            Fault::PartitionFlap => FLAP_HALF + Duration::from_secs(5),
        }
    }

    /// How long, after the load stops, every confirmed message may take to arrive.
    fn settle_wait(self) -> Duration {
        match self {
            Fault::RollingRestart | Fault::RollingUpgrade => WAIT * 3,
            _ => WAIT * 2,
        }
    }

    /// Only with `LADDER_FAULTS_FULL=1`.
    fn slow(self, replicas: usize) -> bool {
        replicas > 1
            || self.partition()
            || matches!(self, Fault::KillLadder | Fault::RollingRestart | Fault::RollingUpgrade)
    }
}

/// One test at a time, even without `--test-threads=1`: the faults would disturb each other.
static SERIAL: Mutex<()> = Mutex::new(());

/// How long a test waits for a fault test of another process to finish.
const OTHER_RUN_WAIT: Duration = Duration::from_secs(30 * 60);

fn run(test: &str, fault: Fault, replicas: usize) {
    let Some(cluster) = Cluster::from_env() else {
        eprintln!(
            "skipping {test}: {CLUSTER_URLS_VAR} is unset (scripts/faults brings a cluster up and runs the fault tests)"
        );
        return;
    };
    if fault.partition() && !cluster.partitionable() {
        eprintln!(
            "skipping {test}: partitions need the nodes in network namespaces (profile {PARTITION_PROFILE}, \
             scripts/faults --full), not profile {}",
            cluster.profile
        );
        return;
    }
    if fault.slow(replicas) && std::env::var("LADDER_FAULTS_FULL").as_deref() != Ok("1") {
        eprintln!("skipping {test}: a slow fault test, run only with LADDER_FAULTS_FULL=1 (scripts/faults --full)");
        return;
    }
    assert!(
        cluster.urls.len() >= 3,
        "{CLUSTER_URLS_VAR} must name the three nodes of the cluster, in node order"
    );
    let _serial = lock(&SERIAL);
    let _exclusive = ExclusiveUse::wait(OTHER_RUN_WAIT);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(scenario(cluster, fault, replicas));
}

#[test]
fn fault_leader_node_killed() {
    run("fault_leader_node_killed", Fault::LeaderNode, 1);
}

#[test]
fn fault_leader_node_killed_two_replicas() {
    run("fault_leader_node_killed_two_replicas", Fault::LeaderNode, 2);
}

#[test]
fn fault_ladder_node_killed() {
    run("fault_ladder_node_killed", Fault::LadderNode, 1);
}

#[test]
fn fault_ladder_node_killed_two_replicas() {
    run("fault_ladder_node_killed_two_replicas", Fault::LadderNode, 2);
}

#[test]
fn fault_connections_closed() {
    run("fault_connections_closed", Fault::CloseConnections, 1);
}

#[test]
fn fault_connections_closed_two_replicas() {
    run("fault_connections_closed_two_replicas", Fault::CloseConnections, 2);
}

#[test]
fn fault_ladder_killed() {
    run("fault_ladder_killed", Fault::KillLadder, 1);
}

#[test]
fn fault_ladder_killed_two_replicas() {
    run("fault_ladder_killed_two_replicas", Fault::KillLadder, 2);
}

#[test]
fn fault_rolling_restart() {
    run("fault_rolling_restart", Fault::RollingRestart, 1);
}

#[test]
fn fault_rolling_restart_two_replicas() {
    run("fault_rolling_restart_two_replicas", Fault::RollingRestart, 2);
}

/// Only on a cluster of the profile `4.0-cluster` (scripts/faults --full runs it there).
#[test]
fn fault_rolling_upgrade() {
    if std::env::var("LADDER_TEST_BROKER_PROFILE").as_deref() != Ok("4.0-cluster") {
        eprintln!("skipping fault_rolling_upgrade: it runs on the 4.0-cluster profile only (scripts/faults --full)");
        return;
    }
    run("fault_rolling_upgrade", Fault::RollingUpgrade, 1);
}

/// The version [`Fault::RollingUpgrade`] moves the nodes to.
fn upgrade_target() -> String {
    std::env::var("LADDER_FAULTS_UPGRADE_TO").unwrap_or_else(|_| "4.0".into())
}

#[test]
fn fault_partition_ladder_cut_off() {
    run("fault_partition_ladder_cut_off", Fault::PartitionLadder, 1);
}

#[test]
fn fault_partition_ladder_cut_off_two_replicas() {
    run("fault_partition_ladder_cut_off_two_replicas", Fault::PartitionLadder, 2);
}

#[test]
fn fault_partition_minority_leader() {
    run("fault_partition_minority_leader", Fault::PartitionLeader, 1);
}

#[test]
fn fault_partition_minority_leader_two_replicas() {
    run(
        "fault_partition_minority_leader_two_replicas",
        Fault::PartitionLeader,
        2,
    );
}

#[test]
fn fault_partition_one_way() {
    run("fault_partition_one_way", Fault::PartitionOneWay, 1);
}

#[test]
fn fault_partition_one_way_two_replicas() {
    run("fault_partition_one_way_two_replicas", Fault::PartitionOneWay, 2);
}

#[test]
fn fault_partition_flapping_link() {
    run("fault_partition_flapping_link", Fault::PartitionFlap, 1);
}

#[test]
fn fault_partition_flapping_link_two_replicas() {
    run("fault_partition_flapping_link_two_replicas", Fault::PartitionFlap, 2);
}

/// What message `seq` is: where the ladder should take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// First failure: 200ms tier, then the destination.
    Short,
    /// Second failure (`retry-attempt: 1`): 1s tier, then the destination.
    Long,
    /// Third failure (`retry-attempt: 3`): parked with `max-attempts` at intake.
    Park,
}

impl Kind {
    fn of(seq: u64) -> Kind {
        match seq % 10 {
            9 => Kind::Park,
            1 | 5 => Kind::Long,
            _ => Kind::Short,
        }
    }

    fn delay_ms(self) -> u64 {
        match self {
            Kind::Short => 200,
            Kind::Long => 1000,
            Kind::Park => 0,
        }
    }
}

fn seq_of(id: &str) -> Option<u64> {
    id.strip_prefix('m')?.parse().ok()
}

fn props_for(destination: String) -> PropsFor {
    Arc::new(move |seq| {
        let mut headers = FieldTable::default();
        headers.set("retry-to", FieldValue::string(&destination));
        match Kind::of(seq) {
            Kind::Short => {}
            Kind::Long => headers.set("retry-attempt", FieldValue::LongLongInt(1)),
            Kind::Park => headers.set("retry-attempt", FieldValue::LongLongInt(3)),
        }
        BasicProperties::default()
            .with_message_id(&format!("m{seq}"))
            .with_delivery_mode(2)
            .with_headers(headers)
    })
}

/// Everything one scenario set up; dropping it (even on a failed assertion) kills the replicas,
/// starts any node the test took down, and deletes every queue and exchange it declared.
struct Rig {
    cluster: Cluster,
    ns: String,
    names: Names,
    destination: String,
    dir: tempfile::TempDir,
    log_dir: PathBuf,
    replicas: Vec<LadderProcess>,
    replica_nodes: [usize; 2],
    queues: Vec<String>,
    exchanges: Vec<String>,
}

impl Rig {
    fn new(cluster: Cluster, fault: Fault, replicas: usize) -> Rig {
        let hint = match fault {
            Fault::LeaderNode => "flead",
            Fault::LadderNode => "fnode",
            Fault::CloseConnections => "fconn",
            Fault::KillLadder => "fkill",
            Fault::RollingRestart => "froll",
            Fault::RollingUpgrade => "fupgr",
            Fault::PartitionLadder => "fpcut",
            Fault::PartitionLeader => "fpmin",
            Fault::PartitionOneWay => "fpone",
            Fault::PartitionFlap => "fpflap",
        };
        let ns = unique_namespace(&format!("{hint}{replicas}"));
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("ladders")).unwrap();
        std::fs::write(dir.path().join("ladders/default.toml"), LADDER.replace("{ns}", &ns)).unwrap();
        let apply = write_main(dir.path(), "apply", &ns, &cluster.urls_from(LEAD_NODE));
        let config = ladder::config::load(&apply, &HashMap::new()).expect("the test config is valid");
        let (mut queues, exchanges) = declared_names(&config);
        let destination = format!("{ns}-orders");
        queues.push(destination.clone());
        let log_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("faults").join(&ns);
        std::fs::create_dir_all(&log_dir).unwrap();
        Rig {
            cluster,
            names: Names::new(&ns, "default"),
            ns,
            destination,
            dir,
            log_dir,
            replicas: vec![],
            replica_nodes: fault.replica_nodes(),
            queues,
            exchanges,
        }
    }

    /// `ladder apply` through [`LEAD_NODE`], and the destination queue there too.
    async fn declare(&self) {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_ladder"));
        for (key, _) in std::env::vars().filter(|(k, _)| k.starts_with("LADDER_")) {
            command.env_remove(key);
        }
        let output = tokio::time::timeout(
            WAIT,
            command
                .arg("--config")
                .arg(self.dir.path().join("apply.toml"))
                .arg("apply")
                .kill_on_drop(true)
                .output(),
        )
        .await
        .expect("ladder apply finishes")
        .unwrap();
        assert!(
            output.status.success(),
            "ladder apply failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let (conn, _) = connect_any(&self.cluster.urls_from(LEAD_NODE), "ladder-test-declare")
            .await
            .expect("a node answers");
        let channel = conn.create_channel().await.unwrap();
        let mut args = FieldTable::default();
        args.set("x-queue-type", FieldValue::string("quorum"));
        let durable = QueueOptions {
            durable: true,
            ..Default::default()
        };
        tokio::time::timeout(WAIT, channel.queue_declare(&self.destination, durable, args))
            .await
            .expect("declaring the destination timed out")
            .unwrap();
        let _ = conn.close(200, "declared").await;
    }

    /// Starts replica `i` (0-based) and waits until it is ready.
    async fn spawn_replica(&mut self, i: usize) {
        let name = format!("r{}", i + 1);
        let config = write_main(
            self.dir.path(),
            &name,
            &self.ns,
            &self.cluster.urls_from(self.replica_nodes[i]),
        );
        let rust_log = std::env::var("LADDER_FAULTS_RUST_LOG").unwrap_or_else(|_| "ladder=debug".into());
        let mut replica = LadderProcess::spawn(&name, &config, &self.log_dir, &rust_log);
        replica.wait_ready(WAIT).await;
        self.replicas.push(replica);
    }

    /// The connection-name prefix of every connection of replica `i`, or of all with `None`.
    fn connection_prefix(&self, replica: Option<usize>) -> String {
        match replica {
            Some(i) => format!("{}-r{}", self.ns, i + 1),
            None => format!("{}-r", self.ns),
        }
    }

    /// The node each replica's main connection is on.
    async fn ladder_nodes(&self) -> Vec<Option<usize>> {
        let connections = self.cluster.connections_named(&self.connection_prefix(None)).await;
        (0..self.replicas.len())
            .map(|i| {
                let name = self.connection_prefix(Some(i));
                connections
                    .iter()
                    .find(|c| c.connection_name.as_deref() == Some(name.as_str()))
                    .map(|c| c.node)
            })
            .collect()
    }

    fn tier_queue(&self) -> String {
        self.names.tier_queue_named("200ms")
    }
}

impl Rig {
    /// Writes every arrival (`kind,id,seq,confirmed_ms,arrived_ms,due_at_ms,redelivered,reason`,
    /// times relative to the fault) to `arrivals.csv` in the log directory.
    fn dump(&self, report: &ProducerReport, deliveries: &[Arrival], parked: &[Arrival], fault_ms: u64) {
        let rel = |t: u64| t as i64 - fault_ms as i64;
        let mut out = String::from("kind,id,confirmed_ms,arrived_ms,due_at_ms,redelivered,reason\n");
        for (kind, arrivals) in [("delivered", deliveries), ("parked", parked)] {
            for a in arrivals {
                let confirmed = seq_of(&a.id)
                    .and_then(|s| report.confirmed.get(&s))
                    .map_or(String::new(), |t| rel(*t).to_string());
                let due = a.due_at_ms.map_or(String::new(), |d| (d - fault_ms as i64).to_string());
                out.push_str(&format!(
                    "{kind},{},{confirmed},{},{due},{},{}\n",
                    a.id,
                    rel(a.at_ms),
                    a.redelivered,
                    a.reason.as_deref().unwrap_or("")
                ));
            }
        }
        let _ = std::fs::write(self.log_dir.join("arrivals.csv"), out);
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        let failed = std::thread::panicking();
        if failed {
            for r in &self.replicas {
                eprintln!(
                    "--- {} run {} ({}) ---\n{}",
                    r.name,
                    r.runs,
                    r.log_path(r.runs).display(),
                    r.log_tail(40)
                );
            }
        }
        for r in &mut self.replicas {
            r.kill();
        }
        self.cluster.restore_blocking();
        delete_on_cluster_blocking(
            self.cluster.urls.clone(),
            std::mem::take(&mut self.queues),
            std::mem::take(&mut self.exchanges),
        );
        if failed || std::env::var("LADDER_FAULTS_KEEP").as_deref() == Ok("1") {
            eprintln!("service logs kept in {}", self.log_dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.log_dir);
        }
    }
}

/// Writes `<name>.toml` for namespace `ns` with `urls` (a failover list), returns its path.
fn write_main(dir: &Path, name: &str, ns: &str, urls: &[String]) -> PathBuf {
    let urls: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    let text = format!(
        "namespace = \"{ns}\"\nprefetch = {PREFETCH}\nshutdown_grace = \"5s\"\n\n[admin]\nbind = \"127.0.0.1:0\"\npoll_interval = \"1s\"\n\n\
         [amqp]\nurls = [{}]\nconnection_name = \"{ns}-{name}\"\nreconnect_min = \"100ms\"\nreconnect_max = \"1s\"\n",
        urls.join(", ")
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// A replica's admin address, and whether it should be serving (a replica killed for good in
/// the two-replica case should not).
type Target = (Option<SocketAddr>, bool);

/// Polls `/ready` of the replicas that should be serving, every 100 ms, and records when
/// "all of them ready" changes.
struct ReadyWatch {
    /// Per replica.
    targets: Arc<Mutex<Vec<Target>>>,
    /// `(ms since the epoch, all ready)` at each change.
    changes: Arc<Mutex<Vec<(u64, bool)>>>,
    stop: CancellationToken,
}

impl ReadyWatch {
    fn start(replicas: &[LadderProcess]) -> ReadyWatch {
        let targets = Arc::new(Mutex::new(
            replicas.iter().map(|r| (r.admin(), true)).collect::<Vec<_>>(),
        ));
        let changes = Arc::new(Mutex::new(vec![]));
        let stop = CancellationToken::new();
        let (t, c, s) = (targets.clone(), changes.clone(), stop.clone());
        tokio::spawn(async move {
            let http = reqwest::Client::builder()
                .timeout(Duration::from_millis(500))
                .build()
                .unwrap();
            let mut last = None;
            while !s.is_cancelled() {
                let now: Vec<Target> = lock(&t).clone();
                let mut all = true;
                for (addr, expected) in now {
                    if !expected {
                        continue;
                    }
                    let ok = match addr {
                        Some(addr) => http
                            .get(format!("http://{addr}/ready"))
                            .send()
                            .await
                            .is_ok_and(|r| r.status() == reqwest::StatusCode::OK),
                        None => false,
                    };
                    all &= ok;
                }
                if last != Some(all) {
                    lock(&c).push((now_ms(), all));
                    last = Some(all);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        ReadyWatch { targets, changes, stop }
    }

    fn set(&self, replica: usize, addr: Option<SocketAddr>, expected: bool) {
        lock(&self.targets)[replica] = (addr, expected);
    }

    /// From `fault_ms`: how long until the replicas were all ready for good (0 if they never
    /// stopped being ready), how long in all they were not (at 100 ms resolution), and whether
    /// they are ready now.
    fn recovery(&self, fault_ms: u64) -> (u64, u64, bool) {
        let changes = lock(&self.changes).clone();
        let ready_now = changes.last().is_some_and(|(_, ready)| *ready);
        let went_down = changes.iter().any(|(at, ready)| *at >= fault_ms && !ready);
        let back = changes
            .iter()
            .rev()
            .find(|(at, ready)| *at >= fault_ms && *ready)
            .map(|(at, _)| at - fault_ms);
        let mut unready = 0;
        let mut down_since = None;
        for (at, ready) in changes.iter().filter(|(at, _)| *at >= fault_ms) {
            match (ready, down_since) {
                (false, None) => down_since = Some(*at),
                (true, Some(since)) => {
                    unready += at - since;
                    down_since = None;
                }
                _ => {}
            }
        }
        if let Some(since) = down_since {
            unready += now_ms() - since;
        }
        (if went_down { back.unwrap_or(u64::MAX) } else { 0 }, unready, ready_now)
    }
}

impl Drop for ReadyWatch {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Percentile `p` (0..=100) of `values` (sorted in place); 0 when empty.
fn percentile(values: &mut [i64], p: usize) -> i64 {
    if values.is_empty() {
        return 0;
    }
    values.sort_unstable();
    values[((values.len() - 1) * p) / 100]
}

/// Where every confirmed message ended up.
struct Accounting {
    /// Confirmed, neither delivered nor parked.
    lost: Vec<u64>,
    /// Distinct ids delivered, and parked.
    delivered: usize,
    parked: usize,
    /// Extra copies published by the service: deliveries beyond the first that the broker had
    /// not delivered before (a fresh message, so a second publish), parked records beyond the
    /// first, and ids both delivered and parked.
    duplicates: usize,
    /// Redeliveries to the test's own consumer after it lost its connection (not the service's).
    client_redeliveries: usize,
    /// Parked with another reason than `max-attempts`, or parked though they should have been
    /// delivered: `(id, reason)`.
    unexpected_parked: Vec<(String, String)>,
    /// Delivered, but not confirmed to the producer (the confirm was lost with its connection).
    unconfirmed_seen: usize,
}

fn account(report: &ProducerReport, deliveries: &[Arrival], parked: &[Arrival]) -> Accounting {
    let mut delivered: HashMap<&str, (usize, usize)> = HashMap::new();
    for a in deliveries {
        let e = delivered.entry(a.id.as_str()).or_default();
        e.0 += 1;
        if !a.redelivered {
            e.1 += 1;
        }
    }
    let mut parked_ids: HashMap<&str, usize> = HashMap::new();
    let mut unexpected_parked = vec![];
    for a in parked {
        *parked_ids.entry(a.id.as_str()).or_default() += 1;
        let reason = a.reason.clone().unwrap_or_default();
        let expected = seq_of(&a.id).map(Kind::of) == Some(Kind::Park);
        if reason != "max-attempts" || !expected {
            unexpected_parked.push((a.id.clone(), reason));
        }
    }
    let mut duplicates = 0;
    let mut client_redeliveries = 0;
    for (all, fresh) in delivered.values() {
        let service = fresh.saturating_sub(1);
        duplicates += service;
        client_redeliveries += all - 1 - service;
    }
    duplicates += parked_ids.values().map(|n| n - 1).sum::<usize>();
    duplicates += parked_ids.keys().filter(|id| delivered.contains_key(*id)).count();
    let mut lost: Vec<u64> = report
        .confirmed
        .keys()
        .filter(|seq| {
            let id = format!("m{seq}");
            !delivered.contains_key(id.as_str()) && !parked_ids.contains_key(id.as_str())
        })
        .copied()
        .collect();
    lost.sort_unstable();
    let unconfirmed_seen = delivered
        .keys()
        .chain(parked_ids.keys())
        .filter_map(|id| seq_of(id))
        .filter(|seq| !report.confirmed.contains_key(seq))
        .collect::<std::collections::HashSet<_>>()
        .len();
    Accounting {
        lost,
        delivered: delivered.len(),
        parked: parked_ids.len(),
        duplicates,
        client_redeliveries,
        unexpected_parked,
        unconfirmed_seen,
    }
}

/// Lateness of first deliveries: vs `retry-due-at`, and vs when the publish was confirmed plus
/// the tier's delay (which also counts time spent waiting in intake). `(max, p99, how many over
/// 1 s)` of each.
fn lateness(report: &ProducerReport, deliveries: &[Arrival]) -> ((i64, i64, usize), (i64, i64, usize)) {
    let mut first: HashMap<&str, &Arrival> = HashMap::new();
    for a in deliveries {
        first.entry(a.id.as_str()).or_insert(a);
    }
    let mut vs_due = vec![];
    let mut vs_publish = vec![];
    for a in first.values() {
        if let Some(due) = a.due_at_ms {
            vs_due.push(a.at_ms as i64 - due);
        }
        if let Some(seq) = seq_of(&a.id)
            && let Some(confirmed) = report.confirmed.get(&seq)
        {
            vs_publish.push(a.at_ms as i64 - *confirmed as i64 - Kind::of(seq).delay_ms() as i64);
        }
    }
    let max = |v: &[i64]| v.iter().copied().max().unwrap_or(0);
    let over = |v: &[i64]| v.iter().filter(|l| **l > 1000).count();
    (
        (max(&vs_due), percentile(&mut vs_due, 99), over(&vs_due)),
        (max(&vs_publish), percentile(&mut vs_publish, 99), over(&vs_publish)),
    )
}

/// How long after `healed_ms` the last retry that came due before it arrived (0 if every one
/// arrived before): the time the backlog of the fault took to drain.
fn drained_after(deliveries: &[Arrival], healed_ms: u64) -> u64 {
    let mut first: HashMap<&str, &Arrival> = HashMap::new();
    for a in deliveries {
        first.entry(a.id.as_str()).or_insert(a);
    }
    first
        .values()
        .filter(|a| a.due_at_ms.is_some_and(|due| due <= healed_ms as i64))
        .map(|a| a.at_ms.saturating_sub(healed_ms))
        .max()
        .unwrap_or(0)
}

/// The longest time without a delivery in `[from_ms, to_ms]`, and the first delivery after
/// `from_ms` (ms after it).
fn outage(deliveries: &[Arrival], from_ms: u64, to_ms: u64) -> (u64, u64) {
    let mut times: Vec<u64> = deliveries
        .iter()
        .map(|a| a.at_ms)
        .filter(|t| *t >= from_ms && *t <= to_ms)
        .collect();
    times.sort_unstable();
    let first = times.first().map_or(u64::MAX, |t| t - from_ms);
    let mut longest = first;
    let mut previous = from_ms;
    for t in times.iter().copied().chain(std::iter::once(to_ms)) {
        longest = longest.max(t - previous);
        previous = t;
    }
    (longest, first)
}

/// Waits `d`, and meanwhile, until it is seen, notes when `replica`'s session count
/// (`ladder_reconnects_total`) rose above `before`: ms after `fault_ms`.
async fn watch_for(replica: &LadderProcess, d: Duration, fault_ms: u64, before: f64, detected: &mut Option<u64>) {
    let until = tokio::time::Instant::now() + d;
    while tokio::time::Instant::now() < until {
        if detected.is_none()
            && let Ok(Some(n)) =
                tokio::time::timeout(Duration::from_millis(300), replica.metric("ladder_reconnects_total")).await
            && n > before
        {
            *detected = Some(now_ms() - fault_ms);
        }
        tokio::time::sleep(
            Duration::from_millis(100).min(until.saturating_duration_since(tokio::time::Instant::now())),
        )
        .await;
    }
}

async fn scenario(cluster: Cluster, fault: Fault, replicas: usize) {
    cluster.ensure_up().await;
    let mut rig = Rig::new(cluster, fault, replicas);
    rig.declare().await;
    for i in 0..replicas {
        rig.spawn_replica(i).await;
    }
    let leaders = rig.cluster.leaders(&rig.ns).await;
    let tier_leader = leaders
        .iter()
        .find(|(q, _)| *q == rig.tier_queue())
        .map(|(_, n)| *n)
        .expect("the tier queue has a leader");
    let ladder_nodes = rig.ladder_nodes().await;
    eprintln!(
        "{} with {replicas} replica(s) in {}: leaders {leaders:?}, replicas connected to nodes {ladder_nodes:?}",
        fault.name(),
        rig.ns
    );

    // the load, and the test's view of the destination and the parking lot
    let client_urls = rig.cluster.urls_from(CLIENT_NODE);
    let delivered = Follower::start(client_urls.clone(), rig.destination.clone(), false);
    let parked = Follower::start(client_urls.clone(), rig.names.parked.clone(), true);
    let started_ms = now_ms();
    let producer = Producer::start(
        client_urls,
        rig.names.exchange.clone(),
        RATE,
        props_for(rig.destination.clone()),
    );
    let watch = ReadyWatch::start(&rig.replicas);
    if fault.partition() {
        // the first deliveries after a partition case's heal can take a few seconds (new
        // queues elect their leaders while the cluster settles): wait for one, bounded
        let _ = common::poll_until(WAIT, async || {
            (!delivered.snapshot().is_empty()).then_some(()).ok_or(())
        })
        .await;
    }
    tokio::time::sleep(WARMUP).await;
    assert!(
        !delivered.snapshot().is_empty(),
        "nothing was delivered before the fault; the setup is broken"
    );
    // a rolling upgrade: retries waiting in the delay levels through it (a `retry-delay` longer
    // than any step, composed from the levels, coming due while the nodes go through it)
    let levelled: Vec<String> = if fault == Fault::RollingUpgrade {
        let ids: Vec<String> = (0..LEVELLED).map(|i| format!("lv{i}")).collect();
        let (conn, _) = connect_any(&rig.cluster.urls_from(CLIENT_NODE), "ladder-test-levels")
            .await
            .expect("a node answers");
        let channel = conn.create_channel().await.unwrap();
        channel.confirm_select().await.unwrap();
        for id in &ids {
            let mut headers = FieldTable::default();
            headers.set("retry-to", FieldValue::string(&rig.destination));
            headers.set(
                "retry-delay",
                FieldValue::LongLongInt(LEVELLED_DELAY.as_millis() as i64),
            );
            let props = BasicProperties::default()
                .with_message_id(id)
                .with_delivery_mode(2)
                .with_headers(headers);
            let confirm = channel
                .basic_publish(&rig.names.exchange, "", true, &props, b"levelled")
                .unwrap();
            let confirmed = tokio::time::timeout(WAIT, confirm).await.expect("confirmed").unwrap();
            assert_eq!(confirmed, ladder_amqp::Confirmation::Ack);
        }
        let _ = conn.close(200, "levelled").await;
        ids
    } else {
        vec![]
    };

    // the fault
    let victims = match fault {
        Fault::CloseConnections => {
            let victims = rig.cluster.connections_named(&rig.connection_prefix(None)).await;
            assert!(
                victims.len() >= replicas,
                "the replicas' connections were not found: {victims:?}"
            );
            victims
        }
        _ => vec![],
    };
    let reconnects_before = rig.replicas[0].metric("ladder_reconnects_total").await.unwrap_or(0.0);
    // when replica 1 left its node: its session count rose (ms after the fault)
    let mut detected: Option<u64> = None;
    let fault_ms = now_ms();
    let mut ladder_kills = 0;
    let fault_detail = match fault {
        Fault::LeaderNode => {
            rig.cluster.kill(tier_leader).await;
            tokio::time::sleep(node_down()).await;
            rig.cluster.start(tier_leader).await;
            format!("node {tier_leader}")
        }
        Fault::LadderNode => {
            let node = ladder_nodes[0].expect("replica 1 has a connection");
            rig.cluster.kill(node).await;
            tokio::time::sleep(node_down()).await;
            rig.cluster.start(node).await;
            format!("node {node}")
        }
        Fault::CloseConnections => {
            rig.cluster.close_connections(&victims).await;
            format!("{} connections", victims.len())
        }
        Fault::KillLadder => {
            ladder_kills += 1;
            rig.replicas[0].kill();
            watch.set(0, None, replicas == 1);
            if replicas == 1 {
                rig.replicas[0].respawn();
                rig.replicas[0].wait_ready(WAIT).await;
                watch.set(0, rig.replicas[0].admin(), true);
                "r1 killed, restarted".to_string()
            } else {
                "r1 killed".to_string()
            }
        }
        Fault::RollingRestart => {
            for n in rig.cluster.nodes() {
                rig.cluster.stop(n).await;
                rig.cluster.start(n).await;
                eprintln!("node {n} restarted at +{} ms", now_ms() - fault_ms);
            }
            "nodes 1, 2, 3".to_string()
        }
        Fault::RollingUpgrade => {
            let to = upgrade_target();
            for n in rig.cluster.nodes() {
                rig.cluster.upgrade(n, &to).await;
                eprintln!(
                    "node {n} drained, restarted on {to}, revived at +{} ms",
                    now_ms() - fault_ms
                );
            }
            format!("nodes 1, 2, 3 to {to}")
        }
        Fault::PartitionLadder => {
            let node = ladder_nodes[0].expect("replica 1 has a connection");
            rig.cluster.cut("host", &node.to_string(), false).await;
            watch_for(
                &rig.replicas[0],
                partition_for(),
                fault_ms,
                reconnects_before,
                &mut detected,
            )
            .await;
            rig.cluster.heal().await;
            format!("host and node {node} cut both ways for {:?}", partition_for())
        }
        Fault::PartitionLeader | Fault::PartitionOneWay => {
            assert_eq!(
                ladder_nodes[0],
                Some(tier_leader),
                "replica 1 should be connected to the leader of the ladder's queues"
            );
            let oneway = fault == Fault::PartitionOneWay;
            for other in rig.cluster.nodes().filter(|n| *n != tier_leader) {
                rig.cluster
                    .cut(&tier_leader.to_string(), &other.to_string(), oneway)
                    .await;
            }
            watch_for(
                &rig.replicas[0],
                partition_for(),
                fault_ms,
                reconnects_before,
                &mut detected,
            )
            .await;
            rig.cluster.heal().await;
            format!(
                "leader node {tier_leader} cut from the others{} for {:?}",
                if oneway { " one way (its packets dropped)" } else { "" },
                partition_for()
            )
        }
        Fault::PartitionFlap => {
            let node = ladder_nodes[0].expect("replica 1 has a connection");
            let until = tokio::time::Instant::now() + FLAP_FOR;
            let mut flaps = 0;
            while tokio::time::Instant::now() < until {
                rig.cluster.link(node, false).await;
                watch_for(&rig.replicas[0], FLAP_HALF, fault_ms, reconnects_before, &mut detected).await;
                rig.cluster.link(node, true).await;
                watch_for(&rig.replicas[0], FLAP_HALF, fault_ms, reconnects_before, &mut detected).await;
                flaps += 1;
            }
            rig.cluster.heal().await;
            format!("node {node}'s link down {FLAP_HALF:?} and up {FLAP_HALF:?}, {flaps} times")
        }
    };
    let fault_end_ms = now_ms();
    tokio::time::sleep(AFTER).await;
    let report = producer.finish().await;
    let stopped_ms = now_ms();

    // every confirmed message must arrive: delivered or parked
    let deadline = tokio::time::Instant::now() + fault.settle_wait();
    loop {
        let acc = account(&report, &delivered.snapshot(), &parked.snapshot());
        if acc.lost.is_empty() || tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // late duplicates: a redelivered intake message waits in a tier again
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for r in rig.replicas.iter_mut().filter(|r| r.is_running()) {
        r.wait_ready(WAIT).await;
    }
    let (ready_ms, unready_ms, ready_now) = watch.recovery(fault_ms);
    let mut reconnects = vec![];
    for r in &rig.replicas {
        reconnects.push(if r.is_running() {
            r.metric("ladder_reconnects_total").await.unwrap_or(-1.0) as i64
        } else {
            -1
        });
    }
    let follower_reconnects = delivered.reconnects.load(Ordering::Relaxed) + parked.reconnects.load(Ordering::Relaxed);
    if !levelled.is_empty() {
        let deadline = tokio::time::Instant::now() + WAIT * 2;
        let missing = loop {
            let seen: std::collections::HashSet<String> = delivered.snapshot().into_iter().map(|a| a.id).collect();
            let missing: Vec<&String> = levelled.iter().filter(|id| !seen.contains(*id)).collect();
            if missing.is_empty() || tokio::time::Instant::now() >= deadline {
                break missing.len();
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        eprintln!(
            "delay levels through the upgrade: {} retries of {LEVELLED_DELAY:?}, {missing} missing",
            levelled.len()
        );
        assert_eq!(
            missing, 0,
            "retries waiting in the delay levels were lost in the upgrade"
        );
    }
    let deliveries = delivered.finish().await;
    let parked = parked.finish().await;
    if fault == Fault::RollingUpgrade {
        // the parking lot kept every entry: read again from its first offset after every node
        // went through the procedure
        let before: std::collections::HashSet<String> = parked
            .iter()
            .filter(|a| a.at_ms < fault_ms)
            .map(|a| a.id.clone())
            .collect();
        assert!(
            !before.is_empty(),
            "nothing was parked before the upgrade; the setup is broken"
        );
        let reread = Follower::start(rig.cluster.urls_from(CLIENT_NODE), rig.names.parked.clone(), true);
        let deadline = tokio::time::Instant::now() + WAIT;
        let missing = loop {
            let seen: std::collections::HashSet<String> = reread.snapshot().into_iter().map(|a| a.id).collect();
            let missing = before.iter().filter(|id| !seen.contains(*id)).count();
            if missing == 0 || tokio::time::Instant::now() >= deadline {
                break missing;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let _ = reread.finish().await;
        eprintln!(
            "parking lot after the upgrade: {} entries parked before it, {missing} missing",
            before.len()
        );
        assert_eq!(missing, 0, "parked entries were lost in the upgrade");
    }
    let acc = account(&report, &deliveries, &parked);
    let ((late_max, late_p99, late_over_1s), (extra_max, extra_p99, extra_over_1s)) = lateness(&report, &deliveries);
    rig.dump(&report, &deliveries, &parked, fault_ms);
    let (gap_ms, first_ms) = outage(&deliveries, fault_ms, stopped_ms);
    let drained_ms = drained_after(&deliveries, fault_end_ms);
    let (baseline_gap, _) = outage(&deliveries, started_ms + 1000, fault_ms);
    let disruptions = reconnects.iter().map(|n| (*n).max(0) as u64).sum::<u64>() + ladder_kills;
    let duplicate_bound = 2 * PREFETCH * disruptions.max(1);
    eprintln!(
        "FAULT scenario={} replicas={replicas} fault=\"{fault_detail}\" messages={} lost={} delivered={} parked={} \
         duplicates={} duplicate_bound={duplicate_bound} client_redeliveries={} late_max_ms={late_max} late_p99_ms={late_p99} \
         late_over_1s={late_over_1s} extra_max_ms={extra_max} extra_p99_ms={extra_p99} extra_over_1s={extra_over_1s} \
         first_delivery_ms={first_ms} recovery_gap_ms={gap_ms} drained_after_heal_ms={drained_ms} baseline_gap_ms={baseline_gap} ready_after_ms={ready_ms} \
         unready_ms={unready_ms} fault_duration_ms={} detected_ms={} service_reconnects={reconnects:?} \
         producer_reconnects={} follower_reconnects={follower_reconnects} nacked={} returned={} unconfirmed={} unconfirmed_seen={} \
         unexpected_parked={} leader_node={tier_leader} ladder_nodes={ladder_nodes:?}",
        fault.name(),
        report.confirmed.len(),
        acc.lost.len(),
        acc.delivered,
        acc.parked,
        acc.duplicates,
        acc.client_redeliveries,
        fault_end_ms - fault_ms,
        detected.map_or("-".to_string(), |d| d.to_string()),
        report.reconnects,
        report.nacked,
        report.returned,
        report.unknown,
        acc.unconfirmed_seen,
        acc.unexpected_parked.len(),
    );

    if !acc.lost.is_empty() {
        let sample: Vec<String> = acc
            .lost
            .iter()
            .take(30)
            .map(|s| format!("m{s}({:?}, confirmed at {})", Kind::of(*s), report.confirmed[s]))
            .collect();
        let mut metrics = vec![];
        for r in &rig.replicas {
            let mut m = vec![];
            for name in [
                "ladder_received_messages_total",
                "ladder_scheduled_messages_total",
                "ladder_delivered_messages_total",
                "ladder_parked_messages_total",
                "ladder_publish_failures_total",
                "ladder_returned_messages_total",
            ] {
                m.push(format!("{name}={:?}", r.metric(name).await));
            }
            metrics.push(format!("{}: {}", r.name, m.join(" ")));
        }
        panic!(
            "{} of {} confirmed messages were neither delivered nor parked (fault at {fault_ms}, load stopped at {stopped_ms}): {}\n\
             queues now:\n{}\nservice counters:\n{}",
            acc.lost.len(),
            report.confirmed.len(),
            sample.join(", "),
            rig.cluster.queue_states(&rig.ns).await,
            metrics.join("\n")
        );
    }
    if !acc.unexpected_parked.is_empty() {
        eprintln!(
            "parked other than by max-attempts: {:?}",
            &acc.unexpected_parked[..acc.unexpected_parked.len().min(20)]
        );
    }
    assert!(
        acc.duplicates as u64 <= duplicate_bound,
        "{} duplicates; at most {duplicate_bound} expected (2 × prefetch {PREFETCH} per connection loss or kill)",
        acc.duplicates
    );
    assert!(
        Duration::from_millis(gap_ms) <= fault.recovery_bound(),
        "no delivery for {gap_ms} ms after the fault; the bound is {:?}",
        fault.recovery_bound()
    );
    let fault_duration = Duration::from_millis(fault_end_ms - fault_ms);
    assert!(
        Duration::from_millis(late_max.max(0) as u64) <= fault.lateness_bound(fault_duration),
        "a delivery came {late_max} ms after its retry-due-at; the bound is {:?}",
        fault.lateness_bound(fault_duration)
    );
    assert!(ready_now, "the replicas are not all ready at the end");
    if fault.partition() {
        // issue 39: the backlog of a partition drains within 10 s of the heal
        assert!(
            Duration::from_millis(drained_ms) <= DRAIN_BOUND,
            "the last retry due before the heal arrived {drained_ms} ms after it; the bound is {DRAIN_BOUND:?}"
        );
    }
    // Replica 1 is connected to the node cut off: it must leave it within the bound, whether it
    // had work in flight at the cut or not (a node cut off from the leaders answers reads from
    // stale state, but confirms no probe of the watchdog into N.watchdog).
    if matches!(
        fault,
        Fault::PartitionLadder | Fault::PartitionLeader | Fault::PartitionOneWay
    ) {
        let detected = detected.expect("replica 1 never left its node during the partition");
        assert!(
            Duration::from_millis(detected) <= DETECTION_BOUND,
            "replica 1 left its node {detected} ms after the cut; the bound is {DETECTION_BOUND:?}"
        );
    }
    let ready_bound = if fault.partition() {
        READY_AFTER_HEAL
    } else {
        fault.recovery_bound()
    };
    assert!(
        Duration::from_millis(ready_ms) <= ready_bound + Duration::from_millis(fault_end_ms - fault_ms),
        "/ready took {ready_ms} ms after the fault to answer 200 again, {} ms after it ended",
        ready_ms.saturating_sub(fault_end_ms - fault_ms)
    );
    drop(watch);
    for r in &mut rig.replicas {
        if r.is_running() {
            let status = r.terminate(Duration::from_secs(20)).await;
            assert_eq!(
                status.and_then(|s| s.code()),
                Some(0),
                "{} did not drain cleanly:\n{}",
                r.name,
                r.log_tail(20)
            );
        }
    }
}
