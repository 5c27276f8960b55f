//! A network-namespace lab for end-to-end tests: an underlay bridge with etcd on it, hosts
//! running real `weft run` processes with a TUN data plane, and pods behind each host.
//!
//! The topology and the hub's etcd are built by `scripts/lib/netns.sh` (`netns_hub_up`,
//! `netns_host_up`, `netns_hub_etcd`) and pods by `scripts/lib/cni.sh`: the demo, the bench and
//! the chaos soak build theirs with the same functions, so the lab is defined once. This module
//! owns the lab's life (names, cleanup, logs) and the tests' typed view of it.
//!
//! ```text
//!   <p>hub  bridge br0 192.0.2.254/24 and 2001:db8::fe/64, etcd on 192.0.2.254:2379
//!   <p>hN   a host: eth0 192.0.2.N/24 and 2001:db8::N/64 (veth to the hub's bridge),
//!           default routes via 192.0.2.254 and 2001:db8::fe
//!   <p>pN   a pod behind bridge cni0 in <p>hN, attached by the CNI bridge plugin from subnet.env
//!           (an IPv4 address, and an IPv6 one when subnet.env has FLANNEL_IPV6_SUBNET; on
//!           an IPv6-only network, the IPv6 one alone: [`Lab::pod_ipv6_only`])
//! ```
//!
//! The IPv6 underlay: host N's address is `2001:db8::N` with N as the last 16-bit group, so it
//! is written in hex ([`host_ipv6`]: host 10 is `2001:db8::a`, the hub's 254 is `::fe`). Both
//! ends are added `nodad`, usable at once. Overlay addresses come from 10.244.0.0/16 and, on
//! dual-stack networks, [`IPV6_NETWORK`] (fd00::/8).
//!
//! Contract:
//! - Needs root and the tools in [`REQUIRED_TOOLS`]; [`Lab::new`] panics loudly when either is
//!   missing. A test never skips silently.
//! - Every namespace is named with the lab's own short random prefix (`wt<4 hex>`). Veth pairs
//!   are created from inside the hub with the peer moved straight into its namespace, so no
//!   link, address or route ever appears in (or is taken from) the root namespace.
//! - Dropping the [`Lab`] — also while a test panics — SIGKILLs every process inside its
//!   namespaces, reaps etcd and deletes the namespaces. Every process the lab starts also gets
//!   `PR_SET_PDEATHSIG`, so it dies with the test's thread even if `Drop` never runs.
//! - Sockets in a namespace are opened from a short-lived thread that entered it with
//!   `setns` ([`in_netns`]); a socket keeps its namespace after the thread is gone.
//! - A [`Weft`] keeps its log file; when it is dropped during a panic it prints the log's tail,
//!   and the lab's temp dir (etcd's and every weft's log) is kept and its path printed. Set
//!   `WEFT_E2E_KEEP_LOGS=1` to keep it after passing tests too.

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::etcd::etcd_binary;
use super::kernel_flannel::VxlanLease;
use super::process::{Daemon, die_with_parent, lib_command, lib_run, run_command};
use super::weft::{RunArgs, http_get};

/// etcd's client URL on the underlay (inside the hub namespace): netns.sh's `NETNS_ETCD`.
pub const ETCD: &str = "http://192.0.2.254:2379";

/// The hub bridge's IPv6 address on the underlay (`2001:db8::fe`, 254 in hex as in 192.0.2.254):
/// netns.sh's `NETNS_HUB_IP6`. (The tests ping it: they fail if the two ever part.)
pub const HUB_IPV6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0xfe);
/// The overlay's IPv6 network in the lab's dual-stack configs (and in the `subnet.env` that
/// [`Lab::pod_with_ipv6`] writes for a host without weft).
pub const IPV6_NETWORK: &str = "fd00:10:244::/56";
/// The key prefix (flannel's default).
pub const PREFIX: &str = "/coreos.com/network";
/// weft's health port inside each host namespace (every host has its own loopback).
pub const HEALTH_PORT: u16 = 9797;
/// Lease TTL for every weft in the lab.
pub const TTL: &str = "4s";
/// Tools the lab runs; each must be on `PATH`.
pub const REQUIRED_TOOLS: &[&str] = &[
    "ip", "bridge", "ss", "ping", "iperf3", "etcd", "etcdctl", "setpriv", "unshare", "prlimit",
    "mknod", "sh", "python3", "tcpdump", "nft",
];

/// Host `n`'s IPv6 underlay address: `2001:db8::N`, N the last 16-bit group (so `{n:x}`), as
/// netns.sh's `netns_ip6` gives it.
pub fn host_ipv6(n: u8) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, u16::from(n))
}

/// Panics unless the test runs as root with every tool in [`REQUIRED_TOOLS`].
pub fn require_root_and_tools() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "the end-to-end tests must run as root (they create network namespaces); euid is {euid}"
    );
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs: Vec<PathBuf> = std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .collect();
    let missing: Vec<&str> = REQUIRED_TOOLS
        .iter()
        .copied()
        .filter(|t| !dirs.iter().any(|d| d.join(t).is_file()))
        .collect();
    assert!(
        missing.is_empty(),
        "tools missing for the end-to-end tests: {missing:?} (Debian: iproute2 iputils-ping \
         iperf3 util-linux etcd-server etcd-client nftables; or run scripts/setup.sh)"
    );
}

/// Runs `f` on a fresh thread inside the network namespace `ns` (`/run/netns/<ns>`).
/// Sockets it opens stay in that namespace.
pub fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    let path = format!("/run/netns/{ns}");
    std::thread::scope(|s| {
        let handle = s.spawn(|| {
            let fd = File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
            // SAFETY: setns on a valid namespace fd; it changes only this thread's namespace.
            let rc = unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns into {ns}: {}", std::io::Error::last_os_error());
            f()
        });
        handle.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// Turns transmit checksum offload of `dev` in namespace `ns` on or off (`ethtool -K DEV tx
/// off`, through the legacy `ETHTOOL_STXCSUM` ioctl, so no ethtool binary is needed).
///
/// Why a lab needs it: a packet that crosses veth pairs keeps `CHECKSUM_PARTIAL`, so a UDP
/// socket on the far side receives a kernel VXLAN peer's inner TCP segments with only the
/// pseudo-header sum in their checksum field. A physical NIC completes those checksums on the
/// wire; turning offload off on the kernel peer's underlay veth does the same in software.
pub fn set_tx_checksum(ns: &str, dev: &str, on: bool) {
    const SIOCETHTOOL: libc::c_ulong = 0x8946;
    const ETHTOOL_STXCSUM: u32 = 0x17;
    #[repr(C)]
    struct EthtoolValue {
        cmd: u32,
        data: u32,
    }
    #[repr(C)]
    struct IfReq {
        name: [libc::c_char; libc::IFNAMSIZ],
        data: *mut EthtoolValue,
        _pad: [u8; 16],
    }
    assert!(dev.len() < libc::IFNAMSIZ, "interface name too long: {dev}");
    in_netns(ns, || {
        let sock = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).expect("ioctl socket");
        let mut value = EthtoolValue { cmd: ETHTOOL_STXCSUM, data: u32::from(on) };
        let mut req = IfReq { name: [0; libc::IFNAMSIZ], data: &mut value, _pad: [0; 16] };
        for (d, s) in req.name.iter_mut().zip(dev.bytes()) {
            *d = s as libc::c_char;
        }
        // SAFETY: SIOCETHTOOL with a valid ifreq whose data points at a live ethtool_value.
        let rc = unsafe { libc::ioctl(sock.as_raw_fd(), SIOCETHTOOL, &mut req) };
        assert_eq!(rc, 0, "ETHTOOL_STXCSUM {dev} in {ns}: {}", std::io::Error::last_os_error());
    });
}

/// Runs a command to completion (stdin null) and returns its output, whatever the status.
pub fn output(args: &[&str]) -> Output {
    let mut cmd = Command::new(args[0]);
    cmd.args(&args[1..]).stdin(Stdio::null());
    die_with_parent(&mut cmd).output().unwrap_or_else(|e| panic!("cannot run {args:?}: {e}"))
}

/// Runs a command that must succeed; returns its stdout.
pub fn run(args: &[&str]) -> String {
    run_command(Command::new(args[0]).args(&args[1..]))
}

/// `ip netns exec NS ARGS...`: must succeed; returns stdout.
pub fn ns_run(ns: &str, args: &[&str]) -> String {
    let mut all = vec!["ip", "netns", "exec", ns];
    all.extend_from_slice(args);
    run(&all)
}

/// `ip netns exec NS ARGS...` to completion, whatever the status.
pub fn ns_output(ns: &str, args: &[&str]) -> Output {
    let mut all = vec!["ip", "netns", "exec", ns];
    all.extend_from_slice(args);
    output(&all)
}

/// Starts `ip netns exec NS ARGS...` in the background, stdout and stderr piped.
pub fn ns_spawn(ns: &str, args: &[&str]) -> Child {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns]).args(args);
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    die_with_parent(&mut cmd)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {args:?} in {ns}: {e}"))
}

/// Starts `ARGS...` in namespace `ns` in the background as an unprivileged local user: uid and
/// gid 65534, no supplementary groups, no capabilities (effective, inheritable, ambient or
/// bounding), and a `PATH` of system directories only. Stdout and stderr are piped.
pub fn ns_spawn_nobody(ns: &str, args: &[&str]) -> Child {
    let mut all = vec!["env", "PATH=/usr/bin:/bin", "setpriv", "--reuid", "65534", "--regid"];
    all.extend_from_slice(&["65534", "--clear-groups", "--inh-caps", "-all", "--ambient-caps"]);
    all.extend_from_slice(&["-all", "--bounding-set", "-all", "--pdeathsig", "KILL", "--"]);
    all.extend_from_slice(args);
    ns_spawn(ns, &all)
}

/// The outcome of a `ping` run.
#[derive(Clone, Debug)]
pub struct PingResult {
    /// Echo requests sent.
    pub transmitted: u32,
    /// Replies received.
    pub received: u32,
    /// ping's whole output.
    pub text: String,
}

impl PingResult {
    /// Parses ping's summary line (`N packets transmitted, M received`).
    pub fn parse(text: String) -> Self {
        let line = text.lines().find(|l| l.contains("packets transmitted")).unwrap_or("");
        let num = |word: &str| -> u32 {
            line.split(',')
                .find(|p| p.contains(word))
                .and_then(|p| p.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
        };
        Self { transmitted: num("transmitted"), received: num("received"), text }
    }

    /// Fraction of requests lost (1.0 when nothing was sent).
    pub fn loss(&self) -> f64 {
        if self.transmitted == 0 {
            return 1.0;
        }
        1.0 - f64::from(self.received) / f64::from(self.transmitted)
    }
}

/// `-4` or `-6`: the family flag of ping and iperf3 for `dst`.
fn family_flag(dst: IpAddr) -> &'static str {
    if dst.is_ipv6() { "-6" } else { "-4" }
}

/// `ping -4|-6 -c COUNT -i INTERVAL -W 1 DST` from namespace `ns`, to completion. `dst` is an
/// [`Ipv4Addr`], an [`Ipv6Addr`] or an [`IpAddr`]; the family flag follows it.
pub fn ping_lossy(ns: &str, dst: impl Into<IpAddr>, count: u32, interval: f64) -> PingResult {
    let dst = dst.into();
    let (c, i, d) = (count.to_string(), format!("{interval}"), dst.to_string());
    let out = ns_output(ns, &["ping", family_flag(dst), "-n", "-c", &c, "-i", &i, "-W", "1", &d]);
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    PingResult::parse(text)
}

/// Which families [`ping_all_pairs`] pings over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Families {
    /// IPv4 only.
    V4,
    /// IPv4, and IPv6 (every pod must have an IPv6 address).
    Both,
}

/// Pings every ordered pair of pods over `families` (3 echoes each, in parallel); panics on
/// any loss, or when a pod lacks the IPv6 address `Both` needs.
pub fn ping_all_pairs(pods: &[Pod], families: Families) {
    let ip6 = |p: &Pod| p.ip6.unwrap_or_else(|| panic!("pod {} has no IPv6 address", p.ns));
    std::thread::scope(|s| {
        for a in pods {
            for b in pods {
                if a.ns != b.ns {
                    s.spawn(move || ping_ok(&a.ns, b.ip, 3));
                    if families == Families::Both {
                        let dst = ip6(b);
                        s.spawn(move || ping_ok(&a.ns, dst, 3));
                    }
                }
            }
        }
    });
}

/// `ping -4|-6 -c COUNT -i 0.2 -W 1`; panics unless every reply came back.
pub fn ping_ok(ns: &str, dst: impl Into<IpAddr>, count: u32) -> PingResult {
    let dst = dst.into();
    let r = ping_lossy(ns, dst, count, 0.2);
    assert!(
        r.transmitted == count && r.received == count,
        "ping {ns} -> {dst}: {}/{} replies\n{}",
        r.received,
        r.transmitted,
        r.text
    );
    r
}

/// Starts a ping in the background; finish it with [`finish_ping`].
pub fn spawn_ping(ns: &str, dst: impl Into<IpAddr>, count: u32, interval: f64) -> Child {
    let dst = dst.into();
    let (c, i, d) = (count.to_string(), format!("{interval}"), dst.to_string());
    ns_spawn(ns, &["ping", family_flag(dst), "-n", "-c", &c, "-i", &i, "-W", "1", &d])
}

/// Waits for a background ping and parses its summary.
pub fn finish_ping(child: Child) -> PingResult {
    let out = child.wait_with_output().expect("wait for ping");
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    PingResult::parse(text)
}

/// An iperf3 server for one test (`-s -1`), killed on drop.
pub struct Iperf3Server {
    child: Option<Child>,
}

impl Iperf3Server {
    /// Starts `iperf3 -s -1` in `ns`.
    pub fn start(ns: &str) -> Self {
        Self { child: Some(ns_spawn(ns, &["iperf3", "-s", "-1"])) }
    }
}

impl Drop for Iperf3Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs an iperf3 TCP test for `secs` from `client_ns` to `server_ip` (an iperf3 server must
/// be started there, see [`Iperf3Server`]; it listens on both families); returns the
/// receiver's bits per second. An IPv6 `server_ip` runs `iperf3 -6`.
pub fn iperf3_bps(client_ns: &str, server_ip: impl Into<IpAddr>, secs: u32) -> f64 {
    let server_ip = server_ip.into();
    let (ip, t) = (server_ip.to_string(), secs.to_string());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut args = vec!["iperf3", "-c", &ip, "-t", &t, "-J", "--connect-timeout", "3000"];
        if server_ip.is_ipv6() {
            args.push("-6");
        }
        let out = ns_output(client_ns, &args);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        if let Some(bps) = json["end"]["sum_received"]["bits_per_second"].as_f64() {
            check_iperf3_stream(&json, &format!("iperf3 {client_ns} -> {server_ip}"));
            return bps;
        }
        let err = json["error"].as_str().unwrap_or("").to_owned();
        // The server may not listen yet: retry "connection refused" for a few seconds.
        if err.contains("refused") && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        panic!(
            "iperf3 {client_ns} -> {server_ip} failed ({}): {err}\n{text}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// What a working overlay gives an iperf3 TCP stream beyond "some bits arrived": every
/// interval of the run carried data (no stall, as a route flapping or a worker wedged would
/// make), something arrived in every one, and the receiver got nearly all the sender wrote
/// (the rest in flight when the sender stopped).
fn check_iperf3_stream(json: &serde_json::Value, label: &str) {
    let intervals = json["intervals"].as_array().map(Vec::as_slice).unwrap_or_default();
    assert!(!intervals.is_empty(), "{label}: no intervals in iperf3's report");
    let per_interval: Vec<u64> =
        intervals.iter().map(|i| i["sum"]["bytes"].as_u64().unwrap_or(0)).collect();
    assert!(
        per_interval.iter().all(|b| *b > 0),
        "{label}: an interval carried nothing: {per_interval:?}"
    );
    let sent = json["end"]["sum_sent"]["bytes"].as_f64().unwrap_or(0.0);
    let received = json["end"]["sum_received"]["bytes"].as_f64().unwrap_or(0.0);
    assert!(
        sent > 0.0 && received >= 0.9 * sent,
        "{label}: the receiver got {received} of the {sent} bytes sent"
    );
}

/// A pod: a namespace behind the host's `cni0` bridge.
#[derive(Clone, Debug)]
pub struct Pod {
    /// The namespace.
    pub ns: String,
    /// Its address (from host-local: the subnet's `.2` for the first pod).
    pub ip: Ipv4Addr,
    /// Its IPv6 address, when subnet.env had `FLANNEL_IPV6_SUBNET` (host-local's second range:
    /// the subnet's `::2` for the first pod). Not tentative: usable at once.
    pub ip6: Option<Ipv6Addr>,
}

/// A pod on an IPv6-only network ([`Lab::pod_ipv6_only`]): a namespace behind the host's
/// `cni0` bridge with an IPv6 address alone.
#[derive(Clone, Debug)]
pub struct Pod6 {
    /// The namespace.
    pub ns: String,
    /// Its address (host-local's one range, `FLANNEL_IPV6_SUBNET`: its `::2` for the first
    /// pod). Not tentative: usable at once.
    pub ip6: Ipv6Addr,
}

/// The network lab. See the module docs.
pub struct Lab {
    /// The namespace name prefix (`wt<4 hex>`).
    pub prefix: String,
    /// Namespaces created, in order.
    namespaces: Mutex<Vec<String>>,
    etcd: Mutex<Option<Child>>,
    // Taken in `Drop` after every process is dead; kept on disk when a test fails.
    dir: Option<tempfile::TempDir>,
}

fn weft_bin() -> &'static str {
    env!("CARGO_BIN_EXE_weft")
}

impl Lab {
    /// A hub with etcd on 192.0.2.254:2379 (inside the hub namespace) and `network_json` set
    /// as the network config.
    pub fn new(network_json: &str) -> Self {
        require_root_and_tools();
        let dir = tempfile::Builder::new().prefix("weft-e2e-").tempdir().expect("tempdir");
        // Readable by the non-root weft (its own files live in subdirectories).
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod lab dir");
        // `ip netns add` fails on an existing name: that claims the prefix atomically.
        let prefix = (0..100)
            .map(|_| format!("wt{:04x}", rand::random::<u16>()))
            .find(|p| output(&["ip", "netns", "add", &format!("{p}hub")]).status.success())
            .expect("could not create a hub namespace with a fresh prefix");
        let lab =
            Self { prefix, namespaces: Mutex::default(), etcd: Mutex::default(), dir: Some(dir) };
        // From here on, a panic drops `lab` and cleans up whatever exists so far.
        let hub = lab.hub();
        lab.namespaces.lock().expect("ns list").push(hub.clone());
        lib_run("netns.sh", "netns_hub_up", &[&lab.prefix]);
        lab.start_etcd();
        let cfg = lab.dir().join("network.json");
        std::fs::write(&cfg, network_json).expect("write network config");
        lab.admin(&["network", "set", &cfg.to_string_lossy()]);
        lab
    }

    /// The lab's temp dir.
    pub fn dir(&self) -> &Path {
        self.dir.as_ref().expect("lab dir").path()
    }

    /// A namespace name with this lab's prefix.
    pub fn ns(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// The hub namespace.
    pub fn hub(&self) -> String {
        self.ns("hub")
    }

    /// Makes namespace `ns` and lists it for cleanup; what goes in it (its loopback too) is the
    /// caller's (`netns_host_up`, `cni_pod_up`).
    fn add_ns(&self, ns: &str) {
        run(&["ip", "netns", "add", ns]);
        self.namespaces.lock().expect("ns list").push(ns.to_owned());
    }

    fn has_ns(&self, ns: &str) -> bool {
        self.namespaces.lock().expect("ns list").iter().any(|n| n == ns)
    }

    fn start_etcd(&self) {
        let hub = self.hub();
        let data = self.dir().join("etcd");
        let log = File::create(self.dir().join("etcd.log")).expect("etcd log");
        let mut cmd = lib_command(
            "netns.sh",
            "netns_hub_etcd",
            &[std::ffi::OsStr::new(&self.prefix), data.as_os_str()],
        );
        cmd.env("ETCD_BIN", etcd_binary())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"))
            .stderr(log);
        let child = die_with_parent(&mut cmd).spawn().expect("start etcd in the hub");
        *self.etcd.lock().expect("etcd") = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (_, body) =
                in_netns(&hub, || http_get(SocketAddr::from(([192, 0, 2, 254], 2379)), "/health"));
            if body.contains("\"health\":\"true\"") {
                return;
            }
            let exited = self
                .etcd
                .lock()
                .expect("etcd")
                .as_mut()
                .is_none_or(|c| !matches!(c.try_wait(), Ok(None)));
            assert!(
                !exited && Instant::now() < deadline,
                "etcd in {hub} did not become healthy:\n{}",
                std::fs::read_to_string(self.dir().join("etcd.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGSTOPs etcd (`true`) or SIGCONTs it: while stopped its sockets stay open and nothing
    /// answers, an outage without resets.
    pub fn pause_etcd(&self, pause: bool) {
        let etcd = self.etcd.lock().expect("etcd");
        let pid = etcd.as_ref().expect("etcd running").id() as i32;
        let signal = if pause { libc::SIGSTOP } else { libc::SIGCONT };
        // SAFETY: kill(2) on the lab's own etcd child (`ip netns exec` execs etcd).
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "signal etcd");
    }

    /// `weft ARGS --etcd-endpoints ETCD --etcd-prefix PREFIX` from the hub; must succeed.
    pub fn admin(&self, args: &[&str]) -> String {
        let mut all = vec![weft_bin()];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--etcd-endpoints", ETCD, "--etcd-prefix", PREFIX]);
        ns_run(&self.hub(), &all)
    }

    /// `etcdctl --endpoints ETCD ARGS` from the hub; must succeed.
    pub fn etcdctl(&self, args: &[&str]) -> String {
        let mut all = vec!["env", "ETCDCTL_API=3", "etcdctl", "--endpoints", ETCD];
        all.extend_from_slice(args);
        ns_run(&self.hub(), &all)
    }

    /// The value of one etcd key, if present.
    pub fn etcd_get(&self, key: &str) -> Option<String> {
        let out = self.etcdctl(&["get", key, "--print-value-only"]);
        let v = out.trim_end_matches('\n');
        (!v.is_empty()).then(|| v.to_owned())
    }

    /// The lease value (flannel's JSON) for `subnet` (`10.244.3.0/24`), if leased.
    pub fn lease_value(&self, subnet: &str) -> Option<serde_json::Value> {
        let key = format!("{PREFIX}/subnets/{}", subnet.replace('/', "-"));
        self.etcd_get(&key).map(|v| serde_json::from_str(&v).expect("lease value is JSON"))
    }

    /// The etcd key and value of the lease whose IPv4 half is `subnet` (`10.244.3.0/24`),
    /// whichever form its key has: IPv4-only (`…/subnets/10.244.3.0-24`) or dual-stack
    /// (`…/subnets/10.244.3.0-24&fd00:10:244:3::-64`), found by listing the prefix. Panics if
    /// there are both.
    pub fn lease_entry(&self, subnet: &str) -> Option<(String, serde_json::Value)> {
        let base = format!("{PREFIX}/subnets/{}", subnet.replace('/', "-"));
        let out = self.etcdctl(&["get", "--prefix", &base]);
        let lines: Vec<&str> = out.lines().collect();
        let found: Vec<(String, serde_json::Value)> = lines
            .chunks(2)
            .filter(|kv| kv[0] == base || kv[0].starts_with(&format!("{base}&")))
            .map(|kv| {
                let v = kv.get(1).copied().unwrap_or("");
                let json = serde_json::from_str(v)
                    .unwrap_or_else(|e| panic!("lease {} is not JSON ({e}): {v:?}", kv[0]));
                (kv[0].to_owned(), json)
            })
            .collect();
        assert!(found.len() <= 1, "two keys for the subnet {subnet}:\n{out}");
        found.into_iter().next()
    }

    /// The lease whose IPv4 half is `subnet`, parsed as a vxlan lease ([`VxlanLease`]); panics
    /// when there is none.
    pub fn vxlan_lease(&self, subnet: &str) -> VxlanLease {
        let (key, value) = self.lease_entry(subnet).unwrap_or_else(|| {
            panic!(
                "no lease for {subnet} in etcd; subnets:\n{}",
                self.etcdctl(&["get", "--prefix", &format!("{PREFIX}/subnets/")])
            )
        });
        VxlanLease::from_etcd(&key, &value)
    }

    /// Host `n` (created on first use): eth0 192.0.2.n/24 and [`host_ipv6`]`(n)`/64 on the hub's
    /// bridge.
    pub fn host(&self, n: u8) -> String {
        let host = self.ns(&format!("h{n}"));
        if self.has_ns(&host) {
            return host;
        }
        // Made (and listed for cleanup) here; netns_host_up wires it.
        self.add_ns(&host);
        lib_run("netns.sh", "netns_host_up", &[&self.prefix, &n.to_string()]);
        host
    }

    /// A node `<p>out<n>` on the underlay outside the Network: 192.0.2.n/24 and
    /// [`host_ipv6`]`(n)`/64 on the hub's bridge, no route to the overlay (its default route is
    /// the hub, which has none either): a pod's packet that reaches it with the pod's address
    /// gets no answer back.
    pub fn outside(&self, n: u8) -> String {
        let name = format!("out{n}");
        let ns = self.ns(&name);
        self.add_ns(&ns);
        lib_run("netns.sh", "netns_node_up", &[&self.prefix, &name, &n.to_string()]);
        ns
    }

    /// [`Lab::pod`] from a copy of `subnet_env` with `FLANNEL_IPMASQ=true`: the bridge does not
    /// masquerade, so the pod's traffic leaves with its own address unless the host (weft's
    /// `--ip-masq`) masquerades it.
    pub fn pod_unmasqueraded(&self, n: u8, subnet_env: &Path) -> Pod {
        let text = std::fs::read_to_string(subnet_env).expect("read subnet.env");
        let text: String = text
            .lines()
            .filter(|l| !l.starts_with("FLANNEL_IPMASQ="))
            .map(|l| format!("{l}\n"))
            .chain(["FLANNEL_IPMASQ=true\n".to_owned()])
            .collect();
        let env = self.dir().join(format!("h{n}-unmasqueraded.env"));
        std::fs::write(&env, &text).expect("write the pod's subnet.env");
        let pod = self.pod(n, &env);
        // kube-flannel's CNI conf delegates with isDefaultGateway: the bridge is the pod's
        // default route, so traffic to outside the Network leaves through the host.
        for (var, flag) in [("FLANNEL_SUBNET=", "-4"), ("FLANNEL_IPV6_SUBNET=", "-6")] {
            if let Some(gw) = text.lines().find_map(|l| l.strip_prefix(var)) {
                let gw = gw.split('/').next().unwrap_or(gw);
                ns_run(&pod.ns, &["ip", flag, "route", "add", "default", "via", gw]);
            }
        }
        pod
    }

    /// Starts `weft run` (TUN data plane) in host `n`'s namespace, with a fresh state dir.
    pub fn start_weft(&self, n: u8, extra: &[&str]) -> Weft {
        started(self.weft_as(n, extra, false, &[], true, true))
    }

    /// [`Lab::start_weft`] without `--public-ip`: weft publishes eth0's address and follows it.
    pub fn start_weft_following_eth0(&self, n: u8, extra: &[&str]) -> Weft {
        started(self.weft_as(n, extra, false, &[], false, true))
    }

    /// [`Lab::start_weft`] without `--public-ip` and without `--iface`: weft picks the
    /// interface of the host's default route (eth0, via 192.0.2.254) by itself.
    pub fn start_weft_by_default_route(&self, n: u8, extra: &[&str]) -> Weft {
        started(self.weft_as(n, extra, false, &[], false, false))
    }

    /// [`Lab::start_weft`] with extra environment variables (the `fault-injection` hooks).
    pub fn start_weft_with_env(&self, n: u8, extra: &[&str], env: &[(&str, &str)]) -> Weft {
        started(self.weft_as(n, extra, false, env, true, true))
    }

    /// Starts `weft run` as uid/gid 65534 with only CAP_NET_ADMIN, in a private mount namespace
    /// whose `/dev/net/tun` is a 0666 node of the lab's own (the host's node is left alone).
    pub fn start_weft_nonroot(&self, n: u8, extra: &[&str]) -> Weft {
        started(self.weft_as(n, extra, true, &[], true, true))
    }

    fn weft_as(
        &self,
        n: u8,
        extra: &[&str],
        nonroot: bool,
        env: &[(&str, &str)],
        public_ip_flag: bool,
        iface_flag: bool,
    ) -> Weft {
        let ns = self.host(n);
        let dir = self.dir().join(format!("h{n}"));
        std::fs::create_dir_all(&dir).expect("host dir");
        let tun_node = self.dir().join("tun");
        if nonroot {
            // SAFETY: chown on a path we just created.
            let c = std::ffi::CString::new(dir.to_string_lossy().as_bytes()).expect("path");
            assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0, "chown host dir");
            if !tun_node.exists() {
                run(&["mknod", &tun_node.to_string_lossy(), "c", "10", "200"]);
                std::fs::set_permissions(&tun_node, std::fs::Permissions::from_mode(0o666))
                    .expect("chmod the lab's tun node");
            }
        }
        Weft {
            n,
            ns,
            dir: dir.clone(),
            log: dir.join("weft.log"),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            nonroot: nonroot.then_some(tun_node),
            nonroot_caps: "+net_admin".to_owned(),
            nonroot_ambient: true,
            health_port: HEALTH_PORT,
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            public_ip_flag,
            iface_flag,
            ttl: TTL.to_owned(),
            stderr: Stderr::LogFile,
            exe: None,
            wrapper: Vec::new(),
            process: Daemon::default(),
        }
    }

    /// Host `n`'s `weft run` as [`Lab::start_weft_nonroot`] would start it, not started yet
    /// (a test sets [`Weft::nonroot_caps`], then calls [`Weft::start`]).
    pub fn unstarted_weft_nonroot(&self, n: u8, extra: &[&str]) -> Weft {
        self.weft_as(n, extra, true, &[], true, true)
    }

    /// Host `n`'s `weft run` as [`Lab::start_weft`] would start it, not started yet: a test
    /// changes what it needs ([`Weft::ttl`], [`Weft::stderr`]), then calls [`Weft::start`].
    pub fn unstarted_weft(&self, n: u8, extra: &[&str]) -> Weft {
        self.weft_as(n, extra, false, &[], true, true)
    }

    /// A pod behind host `n`, attached as a kubelet attaches one on a flannel node: Debian's CNI
    /// `bridge` plugin (with `host-local`) runs with CNI_COMMAND=ADD and the delegate config
    /// flannel's CNI plugin builds from `subnet_env` (`scripts/lib/cni.sh`, shared with the demo
    /// and the chaos soak): bridge cni0 at FLANNEL_SUBNET's .1 as gateway, the pod's address
    /// from that range, a route to FLANNEL_NETWORK, MTU FLANNEL_MTU, and masquerading by the
    /// bridge unless FLANNEL_IPMASQ (weft's hosts here do not masquerade, so the bridge does).
    pub fn pod(&self, n: u8, subnet_env: &Path) -> Pod {
        let (pod, out) = self.cni_pod_up(n, subnet_env);
        // The IPv4 address, then the IPv6 one on a line of its own when the pod has one.
        let mut lines = out.lines();
        let ip = lines.next().unwrap_or("");
        let ip =
            ip.parse().unwrap_or_else(|e| panic!("pod address {ip:?} from CNI ({out:?}): {e}"));
        let ip6 = lines.next().map(|l| {
            l.parse().unwrap_or_else(|e| panic!("pod IPv6 address {l:?} from CNI ({out:?}): {e}"))
        });
        let env = std::fs::read_to_string(subnet_env).unwrap_or_default();
        assert_eq!(
            ip6.is_some(),
            env.contains("FLANNEL_IPV6_SUBNET="),
            "pod {pod}: IPv6 address {ip6:?} vs its subnet.env:\n{env}"
        );
        Pod { ns: pod, ip, ip6 }
    }

    /// [`Lab::pod`] on an IPv6-only network, whose `subnet_env` has the IPv6 pair alone (no
    /// `FLANNEL_NETWORK`/`FLANNEL_SUBNET`): flannel's CNI plugin then gives host-local the one
    /// range `FLANNEL_IPV6_SUBNET` and the one route `FLANNEL_IPV6_NETWORK`, so the bridge cni0
    /// gets the subnet's `::1` and the pod an IPv6 address alone. Panics if it got an IPv4 one.
    pub fn pod_ipv6_only(&self, n: u8, subnet_env: &Path) -> Pod6 {
        let (pod, out) = self.cni_pod_up(n, subnet_env);
        // cni_pod_up prints an empty IPv4 line, then the IPv6 address.
        let mut lines = out.lines();
        let ip = lines.next().unwrap_or("");
        assert!(ip.is_empty(), "pod {pod}: an IPv4 address on an IPv6-only network ({out:?})");
        let ip6 = lines.next().unwrap_or("");
        let ip6 = ip6
            .parse()
            .unwrap_or_else(|e| panic!("pod IPv6 address {ip6:?} from CNI ({out:?}): {e}"));
        Pod6 { ns: pod, ip6 }
    }

    /// Pod `<p>pN` (a new namespace) attached to host `n` by `cni_pod_up` (scripts/lib/cni.sh)
    /// from `subnet_env`: the namespace and what `cni_pod_up` printed.
    fn cni_pod_up(&self, n: u8, subnet_env: &Path) -> (String, String) {
        self.host(n);
        let pod = self.ns(&format!("p{n}"));
        self.add_ns(&pod);
        let ipam = self.dir().join(format!("h{n}-cni"));
        let (n, env, ipam) = (n.to_string(), subnet_env.to_string_lossy(), ipam.to_string_lossy());
        let out = lib_run("cni.sh", "cni_pod_up", &[&*self.prefix, &*n, &*env, &*ipam]);
        (pod, out)
    }

    /// A pod behind host `n` whose bridge takes the address `cni` (`10.244.200.1/24`), for a
    /// host that runs no weft (the kernel VXLAN peer): a `subnet.env` saying so is written for
    /// it, and the pod attached from that by [`Lab::pod`].
    pub fn pod_with(&self, n: u8, cni: &str, mtu: u32) -> Pod {
        self.pod_with_env(n, &format!("FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET={cni}\n"), mtu)
    }

    /// [`Lab::pod_with`] on a dual-stack network: the bridge also takes `cni6`
    /// (`fd00:10:244:c8::1/64`), and the pod an address from it, as flannel writes the IPv6
    /// pair into `subnet.env` (`FLANNEL_IPV6_NETWORK` is [`IPV6_NETWORK`]).
    pub fn pod_with_ipv6(&self, n: u8, cni: &str, cni6: &str, mtu: u32) -> Pod {
        let env = format!(
            "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET={cni}\n\
             FLANNEL_IPV6_NETWORK={IPV6_NETWORK}\nFLANNEL_IPV6_SUBNET={cni6}\n"
        );
        self.pod_with_env(n, &env, mtu)
    }

    /// [`Lab::pod_with_ipv6`] for a node whose flanneld runs with `--ip-masq`
    /// ([`Lab::pod_with_ipmasq`]): the pod's traffic leaves with its own addresses.
    pub fn pod_with_ipv6_ipmasq(&self, n: u8, cni: &str, cni6: &str, mtu: u32) -> Pod {
        let env = format!(
            "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET={cni}\n\
             FLANNEL_IPV6_NETWORK={IPV6_NETWORK}\nFLANNEL_IPV6_SUBNET={cni6}\n"
        );
        self.pod_with_env_masq(n, &env, mtu, true)
    }

    /// [`Lab::pod_with`] for a node whose flanneld runs with `--ip-masq` (`FLANNEL_IPMASQ=true`),
    /// so that the bridge does not masquerade: the pod's traffic leaves with its own address.
    /// What host-gw and direct routing need, whose packets leave through the underlay, where a
    /// masquerade would give them the host's underlay address, which no pod routes back to.
    pub fn pod_with_ipmasq(&self, n: u8, cni: &str, mtu: u32) -> Pod {
        let subnets = format!("FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET={cni}\n");
        self.pod_with_env_masq(n, &subnets, mtu, true)
    }

    fn pod_with_env(&self, n: u8, subnets: &str, mtu: u32) -> Pod {
        self.pod_with_env_masq(n, subnets, mtu, false)
    }

    fn pod_with_env_masq(&self, n: u8, subnets: &str, mtu: u32, ipmasq: bool) -> Pod {
        let env = self.dir().join(format!("h{n}-subnet.env"));
        let text = format!("{subnets}FLANNEL_MTU={mtu}\nFLANNEL_IPMASQ={ipmasq}\n");
        std::fs::write(&env, text).expect("write the pod's subnet.env");
        self.pod(n, &env)
    }

    /// Starts weft on `hosts` (with `extra` flags), waits until each is ready, puts a pod behind
    /// each, and waits until every weft routes to every other host.
    pub fn up(&self, hosts: &[u8], extra: &[&str]) -> (Vec<Weft>, Vec<Pod>) {
        let mut wefts: Vec<Weft> = hosts.iter().map(|&n| self.start_weft(n, extra)).collect();
        for w in &mut wefts {
            w.wait_ready(READY_WITHIN);
        }
        let pods = wefts.iter().map(|w| self.pod(w.n, &w.subnet_file())).collect();
        let peers = (hosts.len() - 1) as f64;
        for w in &wefts {
            w.wait_metric("weft_routes", Duration::from_secs(5), |v| v >= peers);
        }
        (wefts, pods)
    }

    /// `ip netns exec NS ARGS...` to completion, whatever the status.
    pub fn exec(&self, ns: &str, args: &[&str]) -> Output {
        ns_output(ns, args)
    }

    /// The tail of etcd's log.
    pub fn etcd_log(&self) -> String {
        std::fs::read_to_string(self.dir().join("etcd.log")).unwrap_or_default()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let namespaces =
            std::mem::take(&mut *self.namespaces.lock().unwrap_or_else(|p| p.into_inner()));
        // SAFETY: getpid has no preconditions.
        let me = unsafe { libc::getpid() };
        for ns in namespaces.iter().rev() {
            let pids = output(&["ip", "netns", "pids", ns]);
            for pid in String::from_utf8_lossy(&pids.stdout).split_whitespace() {
                if let Ok(pid) = pid.parse::<i32>()
                    && pid != me
                {
                    // SIGCONT first: a stopped process must run to die promptly.
                    // SAFETY: kill(2) on a process inside the lab's own namespace.
                    unsafe {
                        libc::kill(pid, libc::SIGCONT);
                        libc::kill(pid, libc::SIGKILL);
                    }
                }
            }
        }
        if let Some(mut c) = self.etcd.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in namespaces.iter().rev() {
            let mut ok = false;
            for _ in 0..50 {
                if output(&["ip", "netns", "del", ns]).status.success() {
                    ok = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            if !ok {
                eprintln!("lab cleanup: could not delete namespace {ns}");
            }
        }
        let keep = std::env::var_os("WEFT_E2E_KEEP_LOGS").is_some();
        if keep
            && !std::thread::panicking()
            && let Some(dir) = self.dir.take()
        {
            eprintln!("lab {}: logs kept in {}", self.prefix, dir.keep().display());
        }
        if std::thread::panicking() {
            let log = self.etcd_log();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            eprintln!(
                "--- etcd log ({}), last lines ---\n{}",
                self.prefix,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
            if let Some(dir) = self.dir.take() {
                eprintln!("lab {}: logs kept in {}", self.prefix, dir.keep().display());
            }
        }
    }
}

/// `w`, started.
fn started(mut w: Weft) -> Weft {
    w.start();
    w
}

/// One `weft run` process with the TUN data plane, inside a host namespace.
pub struct Weft {
    /// The host number (public IP 192.0.2.n).
    pub n: u8,
    /// The host namespace.
    pub ns: String,
    dir: PathBuf,
    log: PathBuf,
    extra: Vec<String>,
    /// `Some(tun node)` when run as uid 65534 with only CAP_NET_ADMIN.
    nonroot: Option<PathBuf>,
    /// The capabilities a non-root weft gets, in setpriv's form (`+net_admin` unless a test
    /// adds `+net_raw`, which the ipip backend needs).
    pub nonroot_caps: String,
    /// Whether a non-root weft gets [`Weft::nonroot_caps`] as ambient capabilities (as podman
    /// gives them); else only in its bounding set (as a Kubernetes container), so that it has
    /// them only from its binary's file capabilities.
    pub nonroot_ambient: bool,
    /// `--healthz-port` ([`HEALTH_PORT`] but for a [`Weft::twin`]).
    health_port: u16,
    /// Extra environment for the next [`Weft::start`] (fault injection).
    pub env: Vec<(String, String)>,
    /// Whether `--public-ip 192.0.2.n` is passed (else weft takes eth0's address, and
    /// follows it when it changes).
    pub public_ip_flag: bool,
    /// Whether `--iface eth0` is passed (else weft takes the default route's interface).
    pub iface_flag: bool,
    /// `--subnet-lease-ttl` ([`TTL`] unless a test sets another before [`Weft::start`]).
    pub ttl: String,
    /// Where the next [`Weft::start`] sends stderr.
    pub stderr: Stderr,
    /// The binary the next [`Weft::start`] runs (`None`: the one cargo built for the test).
    pub exe: Option<PathBuf>,
    /// A command the next [`Weft::start`] runs weft under (`wrapper... weft run ...`), e.g. a
    /// shell that arranges inherited descriptors as a service manager would.
    pub wrapper: Vec<String>,
    process: Daemon,
}

/// Where a [`Weft`]'s stderr (its log) goes; stdout always goes to the log file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Stderr {
    /// The log file.
    #[default]
    LogFile,
    /// A pipe whose reader copies this many bytes to the log file, then closes its end and
    /// goes away (as `2> >(head -c N)`, a crashed log shipper, a restarting journald).
    ReaderGoneAfter(u64),
}

impl Weft {
    /// Starts the process (again), with the same state dir and subnet file.
    pub fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open weft log");
        let public_ip = format!("192.0.2.{}", self.n);
        let run = RunArgs {
            endpoints: ETCD,
            prefix: PREFIX,
            state_dir: &self.dir.join("state"),
            subnet_file: &self.subnet_file(),
            ttl: &self.ttl,
            // Each host's loopback is its own namespace's.
            health: SocketAddr::from((Ipv4Addr::LOCALHOST, self.health_port)),
            dataplane: "tun",
        };
        let exe =
            self.exe.as_ref().map_or_else(|| weft_bin().to_owned(), |e| e.display().to_string());
        let mut weft: Vec<String> = vec![exe];
        weft.extend(run.to_args());
        if self.public_ip_flag {
            weft.extend(["--public-ip".to_owned(), public_ip]);
        }
        if self.iface_flag {
            weft.extend(["--iface".to_owned(), "eth0".to_owned()]);
        }
        weft.extend(self.extra.iter().cloned());
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns]).args(&self.wrapper);
        match &self.nonroot {
            None => {
                cmd.args(&weft);
            }
            Some(tun) => {
                // unshare -m without --fork execs; sh execs setpriv, which execs weft: the
                // child's PID is weft's, so signals reach it directly.
                cmd.args(["unshare", "-m", "--propagation", "private", "--", "sh", "-c"])
                    .arg(format!(
                        "mount --bind \"$0\" /dev/net/tun && exec setpriv --reuid 65534 \
                         --regid 65534 --clear-groups --inh-caps -all{ambient} \
                         --ambient-caps -all{ambient} --bounding-set -all,{caps} \
                         --pdeathsig KILL -- \"$@\"",
                        caps = self.nonroot_caps,
                        ambient = if self.nonroot_ambient {
                            format!(",{}", self.nonroot_caps)
                        } else {
                            String::new()
                        },
                    ))
                    .arg(tun)
                    .args(&weft);
            }
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd.env("WEFT_LOG", "weft=debug,gotatun=debug,info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log fd"));
        match self.stderr {
            Stderr::LogFile => {
                cmd.stderr(log);
                self.process.start(&mut cmd);
            }
            Stderr::ReaderGoneAfter(bytes) => {
                cmd.stderr(Stdio::piped());
                self.process.start(&mut cmd);
                let pipe = self.process.take_stderr().expect("weft's stderr pipe");
                std::thread::spawn(move || {
                    let mut log = log;
                    let _ = std::io::copy(&mut std::io::Read::take(pipe, bytes), &mut log);
                    // The pipe's read end closes here: weft's next write gets EPIPE.
                });
            }
        }
    }

    /// Starts a second `weft run` with this one's flags — the same state dir, subnet file and
    /// TUN name, in the same namespace — but its own health port and log (`weft-twin.log`).
    pub fn twin(&self, health_port: u16) -> Weft {
        self.sibling(self.dir.clone(), "weft-twin.log", health_port)
    }

    /// Starts another `weft run` in this one's namespace with its flags (TUN name included)
    /// but the state dir, subnet file and log (`weft.log`) in `dir`, and its own health port.
    pub fn sibling_in(&self, dir: PathBuf, health_port: u16) -> Weft {
        std::fs::create_dir_all(&dir).expect("sibling dir");
        self.sibling(dir, "weft.log", health_port)
    }

    /// Starts `weft run --takeover` with this one's flags, state dir, subnet file and health
    /// port (the port is handed over too), logging to `weft-next-<k>.log`: the next process
    /// of this host, which takes everything over from this one.
    pub fn successor(&self, k: usize) -> Weft {
        self.successor_as(k, self.nonroot.is_some())
    }

    /// [`Weft::successor`], as uid 65534 with only `CAP_NET_ADMIN` (`nonroot`) or as root,
    /// whatever this one runs as.
    pub fn successor_as(&self, k: usize, nonroot: bool) -> Weft {
        let mut w = self.sibling_unstarted(
            self.dir.clone(),
            &format!("weft-next-{k}.log"),
            self.health_port,
        );
        if !nonroot {
            w.nonroot = None;
        }
        if !w.extra.iter().any(|a| a == "--takeover") {
            w.extra.push("--takeover".to_owned());
        }
        w.exe.clone_from(&self.exe);
        w.start();
        w
    }

    /// Sends `signal` to the process.
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        self.process.signal(signal);
    }

    fn sibling(&self, dir: PathBuf, log: &str, health_port: u16) -> Weft {
        let mut w = self.sibling_unstarted(dir, log, health_port);
        w.start();
        w
    }

    fn sibling_unstarted(&self, dir: PathBuf, log: &str, health_port: u16) -> Weft {
        Weft {
            n: self.n,
            ns: self.ns.clone(),
            log: dir.join(log),
            dir,
            extra: self.extra.clone(),
            nonroot: self.nonroot.clone(),
            nonroot_caps: self.nonroot_caps.clone(),
            nonroot_ambient: self.nonroot_ambient,
            health_port,
            env: Vec::new(),
            public_ip_flag: self.public_ip_flag,
            iface_flag: self.iface_flag,
            ttl: self.ttl.clone(),
            stderr: Stderr::LogFile,
            exe: None,
            wrapper: Vec::new(),
            process: Daemon::default(),
        }
    }

    /// The subnet file.
    pub fn subnet_file(&self) -> PathBuf {
        self.dir.join("subnet.env")
    }

    /// The host's directory (state dir, subnet file, log).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The whole log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `n` lines of the log, without the per-renewal debug chatter.
    pub fn log_tail(&self, n: usize) -> String {
        let log = self.log();
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| !l.contains("store call action=") && !l.contains("lease renewed"))
            .collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// The process ID.
    pub fn pid(&self) -> i32 {
        self.process.pid()
    }

    /// SIGSTOP.
    pub fn suspend(&self) {
        self.process.suspend();
    }

    /// SIGCONT.
    pub fn resume(&self) {
        self.process.resume();
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        self.process.kill();
    }

    /// SIGTERM and wait (up to 10 s) for the exit; returns the exit code.
    pub fn stop(&mut self) -> Option<i32> {
        let (n, log) = (self.n, self.log.clone());
        self.process.stop(move || {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            format!("weft {n}:\n{}", lines[lines.len().saturating_sub(40)..].join("\n"))
        })
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        self.process.running()
    }

    /// GET a health path inside the host namespace: (status, body); 0 when nothing answers.
    pub fn get(&self, path: &str) -> (u16, String) {
        in_netns(&self.ns, || {
            http_get(SocketAddr::from((Ipv4Addr::LOCALHOST, self.health_port)), path)
        })
    }

    /// The subnet (`10.244.3.0/24`) from subnet.env, if written.
    pub fn subnet(&self) -> Option<String> {
        let text = std::fs::read_to_string(self.subnet_file()).ok()?;
        let line = text.lines().find_map(|l| l.strip_prefix("FLANNEL_SUBNET="))?;
        let (ip, len) = line.split_once('/')?;
        let ip: Ipv4Addr = ip.parse().ok()?;
        Some(format!("{}/{len}", Ipv4Addr::from(u32::from(ip) - 1)))
    }

    /// The IPv6 subnet (`fd00:10:244:3::/64`) from subnet.env's `FLANNEL_IPV6_SUBNET`, if
    /// written.
    pub fn subnet6(&self) -> Option<String> {
        let text = std::fs::read_to_string(self.subnet_file()).ok()?;
        let line = text.lines().find_map(|l| l.strip_prefix("FLANNEL_IPV6_SUBNET="))?;
        let (ip, len) = line.split_once('/')?;
        let ip: Ipv6Addr = ip.parse().ok()?;
        Some(format!("{}/{len}", Ipv6Addr::from(u128::from(ip) - 1)))
    }

    /// Whether `/readyz` answers 200 and subnet.env names a subnet.
    pub fn ready(&self) -> bool {
        self.get("/readyz").0 == 200 && self.subnet().is_some()
    }

    /// Waits until ready; returns the subnet. Panics with the log tail on timeout.
    pub fn wait_ready(&mut self, within: Duration) -> String {
        self.wait_ready_with(within, Self::subnet)
    }

    /// [`Weft::wait_ready`] on an IPv6-only network, whose subnet.env names no IPv4 subnet:
    /// waits until `/readyz` answers 200 and subnet.env names an IPv6 subnet; returns that
    /// (`fd00:10:244:3::/64`).
    pub fn wait_ready_ipv6_only(&mut self, within: Duration) -> String {
        self.wait_ready_with(within, Self::subnet6)
    }

    fn wait_ready_with(&mut self, within: Duration, subnet: fn(&Self) -> Option<String>) -> String {
        let deadline = Instant::now() + within;
        loop {
            if self.get("/readyz").0 == 200
                && let Some(subnet) = subnet(self)
            {
                return subnet;
            }
            let running = self.running();
            if !running || Instant::now() > deadline {
                panic!(
                    "weft {} not ready in {within:?} (running: {running}): {:?}\n--- log ---\n{}",
                    self.n,
                    self.get("/readyz"),
                    self.log_tail(60)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the log contains `needle`.
    pub fn wait_log(&self, needle: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while !self.log().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "weft {}: {needle:?} not logged in {within:?}\n--- log ---\n{}",
                self.n,
                self.log_tail(60)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A sample from `/metrics` whose name (with labels, if given) is exactly `name`, e.g.
    /// `weft_routes` or `weft_dataplane_drops_total{dir="rx",reason="wrong_vni"}`.
    pub fn metric(&self, name: &str) -> Option<f64> {
        let (_, body) = self.get("/metrics");
        body.lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| l.rsplit_once(' ').filter(|(k, _)| *k == name).map(|(_, v)| v))
            .and_then(|v| v.parse().ok())
    }

    /// An RX drop counter by reason (0 when absent).
    pub fn rx_drops(&self, reason: &str) -> f64 {
        self.metric(&format!("weft_dataplane_drops_total{{dir=\"rx\",reason=\"{reason}\"}}"))
            .unwrap_or(0.0)
    }

    /// Waits until `metric(name)` satisfies `pred`; returns the value.
    pub fn wait_metric(&self, name: &str, within: Duration, pred: impl Fn(f64) -> bool) -> f64 {
        let deadline = Instant::now() + within;
        loop {
            let v = self.metric(name);
            if let Some(v) = v.filter(|v| pred(*v)) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "weft {}: {name} = {v:?} did not reach the expected value in {within:?}\n\
                 --- log ---\n{}",
                self.n,
                self.log_tail(40)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Weft {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!(
                "--- weft {} ({}) log, last lines ---\n{}",
                self.n,
                self.ns,
                self.log_tail(40)
            );
        }
    }
}

/// How long [`Lab::up`] waits for each weft to turn ready.
pub const READY_WITHIN: Duration = Duration::from_secs(20);

/// Pings until the first reply (one echo at a time, 200 ms wait each); the time it took.
pub fn first_reply(ns: &str, dst: impl Into<IpAddr>, within: Duration) -> Option<Duration> {
    let dst = dst.into();
    let t0 = Instant::now();
    let d = dst.to_string();
    while t0.elapsed() < within {
        let out = ns_output(ns, &["ping", family_flag(dst), "-n", "-c", "1", "-W", "0.2", &d]);
        if out.status.success() {
            return Some(t0.elapsed());
        }
    }
    None
}

/// `ip -j addr show weft0` in namespace `host`, parsed.
pub fn weft0_link(host: &str) -> serde_json::Value {
    serde_json::from_str(&run(&["ip", "-n", host, "-j", "addr", "show", "weft0"]))
        .expect("ip -j addr")
}

/// The IPv4 addresses (`a.b.c.d/len`) of a link as `ip -j addr` shows it.
pub fn inet_addrs(link: &serde_json::Value) -> Vec<String> {
    link[0]["addr_info"]
        .as_array()
        .expect("addr_info")
        .iter()
        .filter(|a| a["family"] == "inet")
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap_or("?"), a["prefixlen"]))
        .collect()
}

/// weft0 on host `w` as docs/dataplane.md ("The TUN device") has it: up, `<subnet>.0/32`,
/// MTU = underlay (1500) − `overhead`, the whole Network routed through it, and the same MTU in
/// subnet.env.
pub fn assert_tun_configured(lab: &Lab, w: &Weft, overhead: u32) {
    let host = lab.host(w.n);
    let subnet = w.subnet().expect("subnet");
    let link = weft0_link(&host);
    let mtu = link[0]["mtu"].as_u64().expect("weft0 mtu");
    assert_eq!(mtu, u64::from(1500 - overhead), "weft0 MTU on host {}", w.n);
    let flags: Vec<&str> =
        link[0]["flags"].as_array().expect("flags").iter().filter_map(|f| f.as_str()).collect();
    assert!(flags.contains(&"UP"), "weft0 not up on host {}: {flags:?}", w.n);
    let addrs = inet_addrs(&link);
    let want = format!("{}/32", subnet.split('/').next().expect("subnet address"));
    assert_eq!(addrs, vec![want], "weft0 addresses on host {}", w.n);
    let routes = run(&["ip", "-n", &host, "route", "show", "10.244.0.0/16"]);
    assert!(routes.contains("dev weft0"), "no Network route via weft0 on host {}: {routes}", w.n);
    let env = std::fs::read_to_string(w.subnet_file()).expect("subnet.env");
    assert!(env.contains(&format!("FLANNEL_MTU={mtu}\n")), "subnet.env vs weft0 MTU {mtu}:\n{env}");
}
