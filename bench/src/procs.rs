//! Processes the benchmark measures: their CPU time and memory from `/proc`, and child processes
//! (the real `ladder run`, the minimal relay, the in-process retry) that are stopped when dropped.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};

/// CPU time and memory of one process at one moment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcStat {
    /// utime + stime.
    pub cpu: Duration,
    /// stime alone: the part spent in the kernel on the process's behalf (system calls).
    pub sys: Duration,
    /// Resident set now (VmRSS), kB.
    pub rss_kb: u64,
    /// Peak resident set (VmHWM), kB.
    pub hwm_kb: u64,
}

/// Clock ticks per second of `/proc/<pid>/stat` times.
fn clk_tck() -> u64 {
    static TCK: OnceLock<u64> = OnceLock::new();
    *TCK.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100)
    })
}

/// The machine's CPU time so far, all cores, from the first line of `/proc/stat`: (total
/// ticks, ticks stolen by the hypervisor — time a virtual CPU wanted to run and did not).
pub fn machine_ticks() -> Result<(u64, u64)> {
    parse_machine_ticks(&std::fs::read_to_string("/proc/stat")?)
}

fn parse_machine_ticks(text: &str) -> Result<(u64, u64)> {
    let line = text
        .lines()
        .next()
        .filter(|l| l.starts_with("cpu "))
        .ok_or_else(|| anyhow!("bad /proc/stat"))?;
    // user nice system idle iowait irq softirq steal (guest and guest_nice are inside user and nice)
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    if fields.len() < 8 {
        return Err(anyhow!("bad /proc/stat: {line}"));
    }
    Ok((fields.iter().sum(), fields[7]))
}

/// The share of the machine's CPU time the hypervisor stole between two [`machine_ticks`], %.
pub fn steal_pct(before: (u64, u64), after: (u64, u64)) -> f64 {
    let total = after.0.saturating_sub(before.0);
    if total == 0 {
        0.0
    } else {
        after.1.saturating_sub(before.1) as f64 * 100.0 / total as f64
    }
}

/// Reads `/proc/<pid>/stat` and `/proc/<pid>/status`.
pub fn stat(pid: u32) -> Result<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).with_context(|| format!("process {pid}"))?;
    // the command name may contain spaces: fields are counted after its closing parenthesis
    let after = &text[text.rfind(')').ok_or_else(|| anyhow!("bad /proc/{pid}/stat"))? + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let (user, sys): (u64, u64) = (fields[11].parse()?, fields[12].parse()?);
    let ticks = user + sys;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Ok(ProcStat {
        cpu: Duration::from_micros(ticks * 1_000_000 / clk_tck()),
        sys: Duration::from_micros(sys * 1_000_000 / clk_tck()),
        rss_kb: kb("VmRSS:"),
        hwm_kb: kb("VmHWM:"),
    })
}

/// The broker's Erlang VM: the `beam.smp` process listening on `port` (the bench may talk to a
/// RabbitMQ 4.3 node of `scripts/broker` on 5701 beside the machine's own on 5672), else the
/// oldest `beam.smp` (the machine's own broker starts first).
pub fn broker_pid_for(port: u16) -> Option<u32> {
    listening_pid(port)
        .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "beam.smp"))
        .or_else(broker_pid)
}

/// The process holding the socket that listens on TCP `port` (IPv4 or IPv6), read from
/// `/proc/net/tcp*` and the processes' file descriptors.
fn listening_pid(port: u16) -> Option<u32> {
    const LISTEN: &str = "0A";
    let mut inodes = vec![];
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let local_port = f.get(1).and_then(|a| a.rsplit(':').next());
            if f.get(3) == Some(&LISTEN) && local_port.and_then(|p| u16::from_str_radix(p, 16).ok()) == Some(port) {
                inodes.extend(f.get(9).map(|i| format!("socket:[{i}]")));
            }
        }
    }
    if inodes.is_empty() {
        return None;
    }
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path())
                && inodes.iter().any(|i| target.as_os_str() == i.as_str())
            {
                return Some(pid);
            }
        }
    }
    None
}

/// The oldest `beam.smp` process (the machine's own broker starts first; a test cluster started
/// later on other ports is not it).
pub fn broker_pid() -> Option<u32> {
    let mut best: Option<(u64, u32)> = None;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(comm) = std::fs::read_to_string(format!("/proc/{pid}/comm")) else {
            continue;
        };
        if comm.trim() != "beam.smp" {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(close) = text.rfind(')') else { continue };
        let start: u64 = text[close + 2..]
            .split_whitespace()
            .nth(19)
            .and_then(|s| s.parse().ok())
            .unwrap_or(u64::MAX);
        if best.is_none_or(|(s, _)| start < s) {
            best = Some((start, pid));
        }
    }
    best.map(|(_, pid)| pid)
}

/// A child process that is stopped (SIGTERM, then SIGKILL after a grace) when dropped.
pub struct Child {
    name: String,
    child: std::process::Child,
    /// For the bench's own subcommands: they exit when this pipe closes, so they never outlive
    /// the bench even if it is killed.
    _stdin: Option<std::process::ChildStdin>,
    /// The last number a `hold` child printed on stdout.
    pub counter: Arc<AtomicU64>,
}

impl Child {
    /// Starts `program args` with `env` added, stderr appended to `log`. `count_stdout`: read
    /// numbers the child prints, one per line, into [`Child::counter`].
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(&str, &str)],
        log: &Path,
        count_stdout: bool,
    ) -> Result<Self> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(log)?;
        let mut cmd = Command::new(program);
        cmd.args(args).stdin(Stdio::piped()).stderr(log);
        cmd.stdout(if count_stdout { Stdio::piped() } else { Stdio::null() });
        // no tracing export, no stray overrides of the config the bench wrote
        for (key, _) in std::env::vars() {
            if key.starts_with("OTEL_") || key.starts_with("LADDER_") {
                cmd.env_remove(key);
            }
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().with_context(|| format!("start {}", program.display()))?;
        let counter = Arc::new(AtomicU64::new(0));
        if let Some(out) = child.stdout.take() {
            let counter = counter.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    if let Ok(n) = line.trim().parse() {
                        counter.store(n, Ordering::Relaxed);
                    }
                }
            });
        }
        let stdin = child.stdin.take();
        Ok(Child {
            name: name.to_string(),
            child,
            _stdin: stdin,
            counter,
        })
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its CPU and memory now.
    pub fn stat(&mut self) -> Result<ProcStat> {
        if let Some(status) = self.child.try_wait()? {
            return Err(anyhow!("{} exited: {status}", self.name));
        }
        stat(self.pid())
    }

    /// SIGKILL, as a crash would; waits for it to be gone.
    pub fn crash(&mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    /// SIGTERM, then SIGKILL if it is still there after `grace`.
    pub fn stop(&mut self, grace: Duration) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("ladder-bench: {} did not stop within {grace:?}; killing it", self.name);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(15));
    }
}

/// Exits the process when stdin closes: a child of the bench must not outlive it.
pub fn exit_with_parent() {
    std::thread::spawn(|| {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
        std::process::exit(0);
    });
}

/// The 1-minute load average.
pub fn load1() -> f64 {
    loadavg()
        .split_whitespace()
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(f64::NAN)
}

/// `/proc/loadavg`'s first three fields.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// `MemAvailable` in kB.
pub fn mem_available_kb() -> u64 {
    meminfo("MemAvailable:")
}

/// A `/proc/meminfo` value in kB.
pub fn meminfo(key: &str) -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod steal_tests {
    use super::*;

    #[test]
    fn steal_is_the_eighth_field_of_the_cpu_line() {
        let text = "cpu  100 5 50 800 10 1 4 30 0 0\ncpu0 50 2 25 400 5 0 2 15 0 0\n";
        assert_eq!(parse_machine_ticks(text).unwrap(), (1000, 30));
        assert!(parse_machine_ticks("cpu0 1 2 3\n").is_err());
        assert!(parse_machine_ticks("cpu  1 2 3\n").is_err());
    }

    #[test]
    fn steal_share_between_two_readings() {
        assert_eq!(steal_pct((1000, 30), (2000, 130)), 10.0);
        assert_eq!(steal_pct((1000, 30), (1000, 30)), 0.0);
    }
}
