//! Simulated hosts for multi-host tests: each host is a Linux network namespace with its
//! own address, joined to the others by a veth pair on a bridge (in a namespace of its
//! own, the switch), running its own
//! `flumen worker` processes. The driver runs in a namespace of its own (a thread of the
//! test that entered it), so every byte between driver and workers, and between workers,
//! crosses a real network stack. Needs root (CI is root); elsewhere the tests say
//! `skipped: needs network namespaces`. Everything made here (namespaces, links, bridge,
//! processes) is removed when the [`TestNet`] drops, pass or fail.

#![allow(dead_code)]

use std::io::BufRead;
use std::net::Ipv4Addr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A worker program and the pool it serves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Role {
    Cpu,
    Accelerator,
}

impl Role {
    fn pool(self) -> &'static str {
        match self {
            Role::Cpu => "cpu",
            Role::Accelerator => "accelerator",
        }
    }
}

/// One simulated host.
pub struct Host {
    /// Its name in the test (`h1`, `driver`).
    pub name: String,
    /// Its network namespace.
    pub netns: String,
    /// Its address on the test's bridge.
    pub ip: Ipv4Addr,
    /// Worker processes started on it.
    workers: Vec<Child>,
}

impl Host {
    /// Process ids of the workers started on it.
    pub fn worker_pids(&self) -> Vec<u32> {
        self.workers.iter().map(|c| c.id()).collect()
    }
}

/// A test network: a bridge, hosts on it, the cluster's secret, CA and certificates.
pub struct TestNet {
    tag: String,
    /// The namespace holding the bridge (`br0`) every host's link is on.
    switch: String,
    subnet: [u8; 2],
    pub hosts: Vec<Host>,
    /// Secret file, CA, certificates, cluster file.
    pub dir: tempfile::TempDir,
    ca: flumen::cluster::tls::ClusterCa,
    /// Each host's CPU share, once [`TestNet::limit_cpu`] made them.
    cpu_groups: Option<CpuGroups>,
}

/// Control groups (cgroup v1: the `cpu` and `cpuacct` hierarchies) giving each host of a
/// [`TestNet`] an equal CPU quota and counting its CPU time.
struct CpuGroups {
    /// The `cpu` and `cpuacct` group directories of each host, by host name.
    dirs: Vec<(String, [PathBuf; 2])>,
}

impl CpuGroups {
    /// The groups of host `name`.
    fn of(&self, name: &str) -> &[PathBuf; 2] {
        &self.dirs.iter().find(|(n, _)| n == name).unwrap().1
    }

    /// Move process `pid` (all its threads) into host `name`'s groups.
    fn join_process(&self, name: &str, pid: u32) {
        for dir in self.of(name) {
            std::fs::write(dir.join("cgroup.procs"), pid.to_string())
                .unwrap_or_else(|e| panic!("moving {pid} into {}: {e}", dir.display()));
        }
    }

    /// CPU seconds used so far by host `name`'s processes.
    fn cpu_seconds(&self, name: &str) -> f64 {
        let ns = std::fs::read_to_string(self.of(name)[1].join("cpuacct.usage")).unwrap();
        ns.trim().parse::<f64>().unwrap_or(0.0) / 1e9
    }

    /// Move the threads left in the groups to their parents and remove the groups.
    fn remove(&self) {
        for (_, dirs) in &self.dirs {
            for dir in dirs {
                let parent = dir.parent().unwrap();
                let left = std::fs::read_to_string(dir.join("tasks")).unwrap_or_default();
                for tid in left.split_whitespace() {
                    let _ = std::fs::write(parent.join("tasks"), tid);
                }
                let _ = std::fs::remove_dir(dir);
            }
        }
    }
}

/// Move the calling thread into the groups `dirs` (threads it starts inherit them).
fn join_groups(dirs: &[PathBuf]) {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    for dir in dirs {
        std::fs::write(dir.join("tasks"), tid.to_string())
            .unwrap_or_else(|e| panic!("moving thread {tid} into {}: {e}", dir.display()));
    }
}

/// Port every worker listens on (each host has its own address).
pub const CPU_PORT: u16 = 7100;
/// Port of each host's accelerator worker.
pub const ACCELERATOR_PORT: u16 = 7200;

/// Bytes sent out of `eth0` in namespace `netns` so far.
fn sent_out_of(netns: &str) -> u64 {
    let out = Command::new("ip")
        .args(["-n", netns, "-s", "-j", "link", "show", "dev", "eth0"])
        .output()
        .unwrap();
    let links: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    links[0]["stats64"]["tx"]["bytes"].as_u64().unwrap_or(0)
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl TestNet {
    /// A network with a driver host and `hosts` worker hosts (`h1`, `h2`, ...); `Err`
    /// saying why where namespaces cannot be made (not root, no `ip`).
    pub fn new(hosts: usize) -> Result<Self, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("needs network namespaces (root, ip netns)".into());
        }
        let random = flumen::cluster::auth::Secret::random().to_hex();
        let tag = format!("fl{}", &random[..4]);
        let subnet = [
            u8::from_str_radix(&random[4..6], 16).unwrap() % 200 + 20,
            u8::from_str_radix(&random[6..8], 16).unwrap(),
        ];
        // The bridge lives in a namespace of its own (the switch), so nothing is made in
        // the machine's own namespace and its firewall never sees the test's traffic.
        let switch = format!("{tag}-switch");
        if let Err(e) = ip(&["netns", "add", &switch]) {
            return Err(format!("needs network namespaces: {e}"));
        }
        if let Err(e) = ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"])
            .and_then(|_| ip(&["-n", &switch, "link", "set", "br0", "up"]))
        {
            let _ = ip(&["netns", "del", &switch]);
            return Err(format!("needs network namespaces: {e}"));
        }
        let mut net = TestNet {
            tag,
            switch,
            subnet,
            hosts: vec![],
            dir: tempfile::tempdir().unwrap(),
            ca: flumen::cluster::tls::ClusterCa::new("flumen test cluster CA").unwrap(),
            cpu_groups: None,
        };
        net.add_host("driver");
        for i in 1..=hosts {
            net.add_host(&format!("h{i}"));
        }
        std::fs::write(net.ca_file(), net.ca.trust().ca_pem()).unwrap();
        let secret = flumen::cluster::auth::Secret::random();
        std::fs::write(net.secret_file(), secret.to_hex()).unwrap();
        std::fs::set_permissions(net.secret_file(), std::fs::Permissions::from_mode(0o600))
            .unwrap();
        Ok(net)
    }

    /// Add host `name` (a namespace on the bridge, the next address) and return its index.
    pub fn add_host(&mut self, name: &str) -> usize {
        let index = self.hosts.len();
        let netns = format!("{}-{name}", self.tag);
        let veth = format!("to-{name}");
        let address = Ipv4Addr::new(10, self.subnet[0], self.subnet[1], index as u8 + 2);
        let cidr = format!("{address}/24");
        let steps: Vec<Vec<&str>> = vec![
            vec!["netns", "add", &netns],
            vec![
                "-n",
                &self.switch,
                "link",
                "add",
                &veth,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                &netns,
            ],
            vec![
                "-n",
                &self.switch,
                "link",
                "set",
                &veth,
                "master",
                "br0",
                "up",
            ],
            vec!["-n", &netns, "addr", "add", &cidr, "dev", "eth0"],
            vec!["-n", &netns, "link", "set", "eth0", "up"],
            vec!["-n", &netns, "link", "set", "lo", "up"],
        ];
        // Recorded first, so a failed step is still cleaned up.
        self.hosts.push(Host {
            name: name.into(),
            netns: netns.clone(),
            ip: address,
            workers: vec![],
        });
        for step in steps {
            ip(&step).unwrap_or_else(|e| panic!("making test host {name}: {e}"));
        }
        index
    }

    /// The host named `name`.
    pub fn host(&self, name: &str) -> &Host {
        self.hosts.iter().find(|h| h.name == name).unwrap()
    }

    fn host_mut(&mut self, name: &str) -> &mut Host {
        self.hosts.iter_mut().find(|h| h.name == name).unwrap()
    }

    /// The cluster's secret file (mode 0600).
    pub fn secret_file(&self) -> PathBuf {
        self.dir.path().join("cluster.secret")
    }

    /// The CA the workers' certificates chain to.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// The cluster file listing `addresses` (written now; rewrite it to add workers).
    pub fn write_cluster_file(&self, addresses: &[String]) -> PathBuf {
        let path = self.dir.path().join("workers.toml");
        let quoted: Vec<String> = addresses.iter().map(|a| format!("\"{a}\"")).collect();
        let text = format!(
            "workers = [{}]\nsecret_file = \"cluster.secret\"\nca = \"ca.pem\"\n",
            quoted.join(", ")
        );
        // Replaced at once, so a reader never sees half a file.
        let partial = path.with_extension("toml.partial");
        std::fs::write(&partial, text).unwrap();
        std::fs::rename(&partial, &path).unwrap();
        path
    }

    /// `host:port` of `role`'s worker on host `name`.
    pub fn address(&self, name: &str, role: Role) -> String {
        let port = match role {
            Role::Cpu => CPU_PORT,
            Role::Accelerator => ACCELERATOR_PORT,
        };
        format!("{}:{port}", self.host(name).ip)
    }

    /// Start a worker of `binary` (`flumen` or a worker example) for `role` on host `name`
    /// with `slots` slots, TLS and the cluster's secret; waits until it listens.
    pub fn start_worker(&mut self, name: &str, role: Role, binary: &Path, slots: usize) {
        self.start_worker_with(name, role, binary, slots, &[]);
    }

    /// [`Self::start_worker`] with `extra` arguments.
    pub fn start_worker_with(
        &mut self,
        name: &str,
        role: Role,
        binary: &Path,
        slots: usize,
        extra: &[&str],
    ) {
        let address = self.address(name, role);
        let host = self.host(name);
        let cert = self.dir.path().join(format!("{name}.pem"));
        let key = self.dir.path().join(format!("{name}.key"));
        if !cert.exists() {
            let identity = self.ca.issue(&[host.ip.to_string()]).unwrap();
            identity.write_files(&cert, &key).unwrap();
        }
        let mut child = Command::new("ip")
            .args(["netns", "exec", &host.netns])
            .arg(binary)
            .args(["worker", "--listen", &address, "--pool", role.pool()])
            .arg("--secret-file")
            .arg(self.secret_file())
            .arg("--tls-cert")
            .arg(&cert)
            .arg("--tls-key")
            .arg(&key)
            .arg("--tls-ca")
            .arg(self.ca_file())
            .args(["--slots", &slots.to_string(), "--lease", "120"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        match first_line(&mut child) {
            Some(line) if line.starts_with("flumen worker listening on") => {}
            other => panic!("worker on {name} did not start: {other:?}"),
        }
        if let Some(groups) = &self.cpu_groups {
            groups.join_process(name, child.id());
        }
        self.host_mut(name).workers.push(child);
    }

    /// Start `program` with `args` on host `name` (killed with the network).
    pub fn spawn_in(&mut self, name: &str, program: &str, args: &[&str]) {
        let child = Command::new("ip")
            .args(["netns", "exec", &self.host(name).netns, program])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        if let Some(groups) = &self.cpu_groups {
            groups.join_process(name, child.id());
        }
        self.host_mut(name).workers.push(child);
    }

    /// Start `program` with `args` on host `name` (in its CPU group) and wait until the
    /// first line it prints starts with `ready` (killed with the network).
    pub fn start_program(&mut self, name: &str, program: &Path, args: &[&str], ready: &str) {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.host(name).netns])
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let first = first_line(&mut child);
        assert!(
            first.as_deref().is_some_and(|l| l.starts_with(ready)),
            "{} on {name} did not start: {first:?}",
            program.display()
        );
        if let Some(groups) = &self.cpu_groups {
            groups.join_process(name, child.id());
        }
        self.host_mut(name).workers.push(child);
    }

    /// Kill every process of host `name` with SIGKILL (a host that dies).
    pub fn kill_host(&mut self, name: &str) {
        let host = self.host_mut(name);
        kill_namespace(&host.netns);
        for child in &mut host.workers {
            let _ = child.wait();
        }
        host.workers.clear();
    }

    /// SIGKILL every process of host `name` without waiting for them (from a callback
    /// that holds the network shared).
    pub fn kill_host_now(&self, name: &str) {
        kill_namespace(&self.host(name).netns);
    }

    /// Give every host (the driver too) `cores` CPUs' worth of time at most (a CFS quota
    /// per 100 ms period), so N hosts have N times one host's CPU on a shared machine, and
    /// count each host's CPU time ([`Self::cpu_seconds`]). Workers started before and after
    /// are in their host's group; the driver's is joined by [`Self::in_driver`]'s thread.
    /// `Err` where no writable cgroup hierarchy is mounted.
    pub fn limit_cpu(&mut self, cores: f64) -> Result<(), String> {
        let period = 100_000u64;
        let quota = ((cores * period as f64) as u64).max(1000);
        let root = Path::new("/sys/fs/cgroup");
        if !root.join("cpu/cpu.cfs_quota_us").exists() || !root.join("cpuacct").exists() {
            // cgroup v2 could cap the workers, not the driver: a thread of this process.
            return Err("needs cgroup v1 cpu and cpuacct hierarchies".into());
        }
        let mut groups = CpuGroups { dirs: vec![] };
        let made = (|| {
            for host in &self.hosts {
                let name = format!("{}-{}", self.tag, host.name);
                let dirs = [
                    root.join("cpu").join(&name),
                    root.join("cpuacct").join(&name),
                ];
                // Recorded first, so a group made before a failure is still removed.
                groups.dirs.push((host.name.clone(), dirs.clone()));
                for dir in &dirs {
                    std::fs::create_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
                }
                std::fs::write(dirs[0].join("cpu.cfs_period_us"), period.to_string())
                    .and_then(|_| {
                        std::fs::write(dirs[0].join("cpu.cfs_quota_us"), quota.to_string())
                    })
                    .map_err(|e| format!("cpu quota for {}: {e}", host.name))?;
            }
            Ok::<(), String>(())
        })();
        if let Err(e) = made {
            groups.remove();
            return Err(e);
        }
        for host in &self.hosts {
            for pid in host.worker_pids() {
                groups.join_process(&host.name, pid);
            }
        }
        self.cpu_groups = Some(groups);
        Ok(())
    }

    /// CPU seconds host `name`'s processes (the driver's threads for `driver`) used so far;
    /// `None` before [`Self::limit_cpu`].
    pub fn cpu_seconds(&self, name: &str) -> Option<f64> {
        Some(self.cpu_groups.as_ref()?.cpu_seconds(name))
    }

    /// Take host `name`'s link down (a network partition) or bring it back up.
    pub fn set_link(&self, name: &str, up: bool) {
        // From inside the host's namespace: this may run on a thread of the driver's.
        let host = self.host(name);
        let state = if up { "up" } else { "down" };
        ip(&["-n", &host.netns, "link", "set", "eth0", state]).unwrap();
    }

    /// Bytes sent out of host `name`'s link so far (its `eth0`'s counter).
    pub fn tx_bytes(&self, name: &str) -> u64 {
        sent_out_of(&self.host(name).netns)
    }

    /// A reading of the bytes every host (the driver too) has sent out of its link so far,
    /// to call from any thread (the driver's included).
    pub fn tx_counter(&self) -> impl Fn() -> u64 + Send + Sync + 'static {
        let namespaces: Vec<String> = self.hosts.iter().map(|h| h.netns.clone()).collect();
        move || namespaces.iter().map(|netns| sent_out_of(netns)).sum()
    }

    /// Limit the bandwidth out of host `name`'s link towards the bridge (tc tbf).
    pub fn limit_bandwidth(&self, name: &str, rate: &str) {
        let host = self.host(name);
        let out = Command::new("tc")
            .args([
                "-n",
                &host.netns,
                "qdisc",
                "replace",
                "dev",
                "eth0",
                "root",
                "tbf",
            ])
            .args(["rate", rate, "burst", "256kb", "latency", "100ms"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "tc: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Run `body` on a thread inside the driver's namespace (and CPU group, after
    /// [`Self::limit_cpu`]), on a runtime whose threads are all in it (threads inherit the
    /// namespace and groups of the thread that starts them).
    pub fn in_driver<T: Send + 'static>(&self, body: impl FnOnce() -> T + Send + 'static) -> T {
        let netns = self.host("driver").netns.clone();
        let groups = self.cpu_groups.as_ref().map(|g| g.of("driver").clone());
        std::thread::spawn(move || {
            enter_namespace(&netns);
            if let Some(dirs) = groups {
                join_groups(&dirs);
            }
            body()
        })
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }
}

/// The first line `child` prints (within 30 s); the rest of its output is read and
/// dropped, so it never blocks on a full pipe.
fn first_line(child: &mut Child) -> Option<String> {
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = std::io::BufReader::new(stdout).lines();
        let _ = tx.send(lines.next());
        for _ in lines.map_while(|l| l.ok()) {}
    });
    rx.recv_timeout(Duration::from_secs(30)).ok()??.ok()
}

/// A runtime for the driver, made on [`TestNet::in_driver`]'s thread: its 2 threads
/// inherit the driver's namespace and CPU group.
pub fn driver_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Move the calling thread into network namespace `netns`.
fn enter_namespace(netns: &str) {
    let file = std::fs::File::open(format!("/var/run/netns/{netns}")).unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: a valid namespace file descriptor; this changes only the calling thread.
    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns {netns}: {}", std::io::Error::last_os_error());
}

/// SIGKILL every process in network namespace `netns`.
fn kill_namespace(netns: &str) {
    let Ok(out) = Command::new("ip").args(["netns", "pids", netns]).output() else {
        return;
    };
    for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
        if let Ok(pid) = pid.parse::<i32>() {
            // SAFETY: sending a signal has no memory-safety preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        for host in &mut self.hosts {
            if host.name != "driver" {
                kill_namespace(&host.netns);
            }
            for child in &mut host.workers {
                let _ = child.kill();
                let _ = child.wait();
            }
            let _ = ip(&["netns", "del", &host.netns]);
        }
        // Deleting the switch takes the bridge and the hosts' links with it.
        let _ = ip(&["netns", "del", &self.switch]);
        if let Some(groups) = &self.cpu_groups {
            groups.remove();
        }
    }
}
