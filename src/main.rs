//! The `weft` command: `run` (the daemon), `network get|set`, `lease list|revoke`.
//!
//! Flags take flanneld's names where flanneld has them; every flag also reads a `WEFT_*`
//! environment variable (`--etcd-endpoints` ⇔ `WEFT_ETCD_ENDPOINTS`).

use std::io::{Read as _, Write as _};
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};

use weft::cli::flanneld_args::{self, Level, Notice, WeftFlag};
use weft::cli::iface::{self, Candidates, IfaceRegex};
use weft::config::NetworkConfig;
use weft::daemon::{self, DataplaneMode, RunOptions};
use weft::dataplane::offload::kernel_bugs::OffloadMode;
use weft::lease::etcd::{EtcdOptions, EtcdStore};
use weft::lease::keys::{self, KeyLayout};
use weft::lease::record::{HistoryState, Subnet};
use weft::lease::store::{LeaseFeed, Store};
use weft::logging;
use weft::secret_file::{self, Secret};
use weft::stop::Stop;

/// `println!` that never panics: a closed stdout (`weft lease list | head -1`) loses the rest.
macro_rules! say {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// `eprintln!` that never panics.
macro_rules! tell {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

#[derive(Parser, Debug)]
#[command(
    name = "weft",
    version,
    about = "A flannel-compatible overlay network daemon with a user-space data plane"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the daemon: lease a subnet, keep it, forward traffic.
    Run(Box<RunArgs>),
    /// Read or write the network config (`<prefix>/config`).
    Network {
        #[command(subcommand)]
        command: NetworkCommand,
    },
    /// Inspect or revoke subnet leases.
    Lease {
        #[command(subcommand)]
        command: LeaseCommand,
    },
    /// Writes the files a package makes from this command line into DIR: man pages
    /// (`man/*.1`), shell completions (`completions/`) and the environment file
    /// (`default/weft`, every `weft run` flag's variable). Used by scripts/package.sh.
    #[command(hide = true)]
    PackageFiles {
        /// Where to write them (created if missing).
        dir: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum NetworkCommand {
    /// Print the network config.
    Get(EtcdArgs),
    /// Validate and write the network config from FILE, or from stdin with `-`.
    Set {
        /// A JSON file in flannel's schema, or `-` for stdin.
        file: String,
        #[command(flatten)]
        etcd: EtcdArgs,
    },
}

#[derive(Subcommand, Debug)]
enum LeaseCommand {
    /// List subnet leases: subnet, public IP, holder, TTL left, history.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        etcd: EtcdArgs,
    },
    /// Delete a subnet's lease, whoever holds it (the holder reclaims it if it still runs).
    Revoke {
        /// The subnet, as `10.244.3.0/24` or `10.244.3.0-24`.
        subnet: Subnet,
        #[command(flatten)]
        etcd: EtcdArgs,
    },
}

#[derive(Args, Debug, Clone)]
struct EtcdArgs {
    /// Comma-separated etcd endpoints.
    #[arg(
        long,
        env = "WEFT_ETCD_ENDPOINTS",
        default_value = "http://127.0.0.1:2379",
        value_delimiter = ','
    )]
    etcd_endpoints: Vec<String>,
    /// Key prefix (flannel's default).
    #[arg(long, env = "WEFT_ETCD_PREFIX", default_value = "/coreos.com/network")]
    etcd_prefix: String,
    /// CA certificate for etcd TLS.
    #[arg(long, env = "WEFT_ETCD_CAFILE")]
    etcd_cafile: Option<PathBuf>,
    /// Client certificate for etcd TLS.
    #[arg(long, env = "WEFT_ETCD_CERTFILE")]
    etcd_certfile: Option<PathBuf>,
    /// Client key for etcd TLS.
    #[arg(long, env = "WEFT_ETCD_KEYFILE")]
    etcd_keyfile: Option<PathBuf>,
    /// etcd user name.
    #[arg(long, env = "WEFT_ETCD_USERNAME")]
    etcd_username: Option<String>,
    /// etcd password. A flag's value is visible to every local user in /proc/<pid>/cmdline
    /// (`ps -ef`): prefer --etcd-password-file, or the environment variable, which only
    /// weft's own user and root can read.
    #[arg(long, env = "WEFT_ETCD_PASSWORD", hide_env_values = true)]
    etcd_password: Option<Secret>,
    /// A file holding the etcd password (one trailing newline is dropped; at most 4 KiB).
    /// Read once at start; a file its group or others may read is used, with a warning.
    #[arg(long, env = "WEFT_ETCD_PASSWORD_FILE", conflicts_with = "etcd_password")]
    etcd_password_file: Option<PathBuf>,
    /// Deadline for each etcd call.
    #[arg(long, env = "WEFT_ETCD_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    etcd_timeout: Duration,
}

#[derive(Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    etcd: EtcdArgs,
    /// Underlay interface (name or address); default: the default route's interface. Given
    /// more than once, the first that exists with an address is used (as flanneld does).
    #[arg(long, env = "WEFT_IFACE")]
    iface: Vec<String>,
    /// A regular expression for the underlay: the first address it matches, else the first
    /// interface name, tried after every --iface. May be given more than once.
    #[arg(long, env = "WEFT_IFACE_REGEX")]
    iface_regex: Vec<IfaceRegex>,
    /// The underlay is the interface of the route to this address (`ip route get`), tried
    /// after --iface and --iface-regex.
    #[arg(long, env = "WEFT_IFACE_CAN_REACH")]
    iface_can_reach: Option<IpAddr>,
    /// Address to publish as PublicIP; default: the underlay interface's address.
    #[arg(long, env = "WEFT_PUBLIC_IP")]
    public_ip: Option<Ipv4Addr>,
    /// Address to publish as PublicIPv6 on a dual-stack vxlan network; default: the underlay
    /// interface's first global IPv6 address (else the IPv6 default route interface's).
    #[arg(long, env = "WEFT_PUBLIC_IPV6")]
    public_ipv6: Option<std::net::Ipv6Addr>,
    /// Where to write flannel's subnet.env.
    #[arg(long, env = "WEFT_SUBNET_FILE", default_value = "/run/flannel/subnet.env")]
    subnet_file: PathBuf,
    /// Directory for this node's identity, VTEP MAC and WireGuard key.
    #[arg(long, env = "WEFT_STATE_DIR", default_value = "/var/lib/weft")]
    state_dir: PathBuf,
    /// The wireguard backend's private key file (made, mode 0600, when missing); default:
    /// `<state-dir>/wireguard-key`. flannel's variable, so a node moved from flanneld keeps its
    /// key.
    #[arg(long, env = "WIREGUARD_KEY_FILE")]
    wireguard_key_file: Option<PathBuf>,
    /// TUN device name: one fixed name (1 to 15 bytes of ASCII letters, digits and
    /// punctuation, no '/', ':' or '%'); a kernel template such as `weft%d` is refused.
    #[arg(long, env = "WEFT_TUN_NAME", default_value = "weft0", value_parser = parse_tun_name)]
    tun_name: String,
    /// Subnet lease TTL (`24h`, `10s`, ...).
    #[arg(long, env = "WEFT_SUBNET_LEASE_TTL", default_value = "24h", value_parser = parse_duration)]
    subnet_lease_ttl: Duration,
    /// Renew no later than this before expiry: minutes as a bare number (flanneld), or a
    /// duration (`30s`). Default: min(60 min, TTL / 4). Renewal also happens at half the TTL.
    #[arg(long, env = "WEFT_SUBNET_LEASE_RENEW_MARGIN", value_parser = parse_margin)]
    subnet_lease_renew_margin: Option<Duration>,
    /// Health server address.
    #[arg(long, env = "WEFT_HEALTHZ_IP", default_value = "0.0.0.0")]
    healthz_ip: IpAddr,
    /// Health server port (0: off).
    #[arg(long, env = "WEFT_HEALTHZ_PORT", default_value_t = 0)]
    healthz_port: u16,
    /// The health server closes a connection that sends no request for this long (after its
    /// accept or its last response). Hidden: the default suits every use but tests.
    #[arg(long, env = "WEFT_HEALTHZ_IDLE_TIMEOUT", default_value = "10s", value_parser = parse_duration, hide = true)]
    healthz_idle_timeout: Duration,
    /// Command run (by /bin/sh -c) when this node's subnet changes; $1 = old, $2 = new.
    #[arg(long, env = "WEFT_ON_SUBNET_CHANGE")]
    on_subnet_change: Option<String>,
    /// Command run (by /bin/sh -c) when this node's lease is lost to another holder.
    #[arg(long, env = "WEFT_ON_LEASE_LOST")]
    on_lease_lost: Option<String>,
    /// A hook still running after this is killed (its whole process group) and counted failed.
    #[arg(long, env = "WEFT_HOOK_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    hook_timeout: Duration,
    /// Delete the lease on a clean shutdown so a new node can use the subnet at once.
    #[arg(long, env = "WEFT_RELINQUISH_ON_EXIT")]
    relinquish_on_exit: bool,
    /// Take over from the weft running on the same --state-dir without losing a packet: its
    /// TUN device, sockets and lease are handed to this process, which forwards before the
    /// other stops. Without a running weft, start as usual.
    #[arg(long, env = "WEFT_TAKEOVER")]
    takeover: bool,
    /// Masquerade traffic leaving the Network, as flanneld's --ip-masq: weft's own nftables
    /// tables (`table ip weft`, `table ip6 weft`), kept for this host's subnet; also written
    /// to subnet.env as FLANNEL_IPMASQ.
    #[arg(long, env = "WEFT_IP_MASQ")]
    ip_masq: bool,
    /// Lease from Kubernetes, as flanneld's kube subnet manager: this node's subnet is its
    /// Node's podCIDR, every node announces its lease in its Node's annotations, and the
    /// network config is read from --net-config-path (docs/kubernetes.md).
    #[arg(long, env = "WEFT_KUBE_SUBNET_MGR")]
    kube_subnet_mgr: bool,
    /// With --kube-subnet-mgr: the kubeconfig to reach the API server with (default: the
    /// pod's service account).
    #[arg(long, env = "WEFT_KUBECONFIG_FILE")]
    kubeconfig_file: Option<PathBuf>,
    /// With --kube-subnet-mgr: the API server's URL (overrides the kubeconfig's).
    #[arg(long, env = "WEFT_KUBE_API_URL")]
    kube_api_url: Option<String>,
    /// With --kube-subnet-mgr: the prefix of the Node annotations (flannel's).
    #[arg(long, env = "WEFT_KUBE_ANNOTATION_PREFIX", default_value = weft::lease::kube::annotations::DEFAULT_PREFIX)]
    kube_annotation_prefix: String,
    /// With --kube-subnet-mgr: the network config file (kube-flannel's ConfigMap).
    #[arg(long, env = "WEFT_NET_CONFIG_PATH", default_value = "/etc/kube-flannel/net-conf.json")]
    net_config_path: PathBuf,
    /// With --ip-masq: masquerade `fully-random` (`=false`: plain; flanneld's
    /// -ip-masq-fully-random-disable).
    #[arg(long, env = "WEFT_IP_MASQ_RANDOM_FULLY", default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    ip_masq_random_fully: bool,
    /// With --ip-masq: accept the Network's forwarded traffic in weft's table (`=false`: not).
    #[arg(long, env = "WEFT_IPTABLES_FORWARD_RULES", default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    iptables_forward_rules: bool,
    /// With --ip-masq: how often weft's tables are checked and repaired, in seconds (0: every
    /// second).
    #[arg(long, env = "WEFT_IPTABLES_RESYNC", default_value_t = 5, value_name = "SECONDS")]
    iptables_resync: u64,
    /// Data plane: `tun` forwards traffic; `none` runs the control plane only (leases,
    /// subnet.env, hooks, health) and needs no privilege.
    #[arg(long, env = "WEFT_DATAPLANE", value_enum, default_value_t = DataplaneMode::Tun)]
    dataplane: DataplaneMode,
    /// Data plane workers (TUN queues, each with its own sockets and thread).
    /// Default: the number of CPUs.
    #[arg(long, env = "WEFT_WORKERS")]
    workers: Option<usize>,
    /// TUN offloads (TSO/checksum with userspace segmentation and GRO): `auto` uses them unless
    /// the running kernel is known to break them (docs/troubleshooting.md); `on` overrides (a
    /// distribution kernel with the fix backported); `off`.
    #[arg(long, env = "WEFT_TUN_OFFLOAD", value_enum, default_value_t = OffloadMode::Auto)]
    tun_offload: OffloadMode,
    /// `--tun-offload off`.
    #[arg(long, env = "WEFT_NO_TUN_OFFLOAD", conflicts_with = "tun_offload")]
    no_tun_offload: bool,
    /// UDP GSO (UDP_SEGMENT) on send: `auto` (unless the kernel is known to break it), `on`,
    /// `off`.
    #[arg(long, env = "WEFT_UDP_GSO", value_enum, default_value_t = OffloadMode::Auto)]
    udp_gso: OffloadMode,
    /// `--udp-gso off`.
    #[arg(long, env = "WEFT_NO_UDP_GSO", conflicts_with = "udp_gso")]
    no_udp_gso: bool,
    /// After a UDP GSO send fails, the socket sends single datagrams for this long, then tries
    /// GSO again (doubling after each failed try, up to an hour). Hidden: the default suits
    /// every use but tests, which want seconds.
    #[arg(long, env = "WEFT_GSO_RETRY_AFTER", default_value = "30s", value_parser = parse_duration, hide = true)]
    gso_retry_after: Duration,
    /// Send UDP GSO messages that never end on a full segment (the workaround `--udp-gso auto`
    /// uses on kernels 7.0 to 7.1.4), whatever the kernel. Hidden: for benchmarks that
    /// measure its cost (scripts/bench.sh).
    #[arg(long, env = "WEFT_GSO_NEVER_EQUAL_TAIL", hide = true)]
    gso_never_equal_tail: bool,
    /// UDP GRO on receive: `auto` (unless the kernel is known to break it), `on`, `off`.
    #[arg(long, env = "WEFT_UDP_GRO", value_enum, default_value_t = OffloadMode::Auto)]
    udp_gro: OffloadMode,
    /// `--udp-gro off`.
    #[arg(long, env = "WEFT_NO_UDP_GRO", conflicts_with = "udp_gro")]
    no_udp_gro: bool,
    /// Turn off recvmmsg/sendmmsg batching: one packet per syscall.
    #[arg(long, env = "WEFT_NO_BATCHING")]
    no_batching: bool,
    /// Threads per worker: 1 runs both directions on one thread (fewer wake-ups), 2 gives
    /// each direction its own.
    #[arg(long, env = "WEFT_WORKER_THREADS", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2))]
    worker_threads: u8,
    /// After a step that moved little (a request, a reply), a one-thread worker keeps looking
    /// for more this long (at most 1ms) before it sleeps, so that a reply coming back soon is
    /// forwarded without a wake-up. It backs off while nothing comes back in time, and spins
    /// at most half of the thread's time. Off (0) by default: on a test bed whose hosts share
    /// two cores it gained nothing measurable (README, "Spinning instead of sleeping").
    #[arg(long, env = "WEFT_SPIN", default_value = "0", value_parser = parse_spin)]
    spin: Duration,
    /// The scheduler slice each forwarding thread asks for (Linux 6.12+; 0 leaves the kernel's
    /// default): a woken thread with a shorter slice than the one running preempts it, so a
    /// packet does not wait behind other work on a busy CPU. The thread's share of the CPU
    /// is unchanged. Off (0) by default: its gain was not shown on the shared test bed
    /// (docs/benchmarks.md, "Weft beside flanneld, step by step"). 100us is the shortest.
    #[arg(long, env = "WEFT_WORKER_SLICE", default_value = "0", value_parser = parse_slice)]
    worker_slice: Duration,
    /// weft repairs drift of its TUN device as the kernel reports it (netlink notifications);
    /// it also reads the device's state this often in case a notification was lost. Hidden:
    /// the default suits every use but tests, which turn it off (an hour) to see the
    /// notifications at work.
    #[arg(long, env = "WEFT_NETLINK_RESYNC", default_value = "10s", value_parser = parse_duration, hide = true)]
    netlink_resync: Duration,
    /// How long a peer's route is trusted after its lease key is gone (an expiry: the peer is
    /// likely partitioned from etcd, and forwarding to it goes on). Counted from when the key
    /// went; the route is dropped only once a listing shows the store answering and the key
    /// still gone, so an etcd outage never drops a route. Until then datagrams from the peer's
    /// address are accepted as that peer's.
    #[arg(long, env = "WEFT_STALE_ROUTE_TTL", default_value = "5m", value_parser = parse_duration)]
    stale_route_ttl: Duration,
    /// Log format.
    #[arg(long, env = "WEFT_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    /// flanneld's `-v`: 1 or more logs weft's debug lines too, when WEFT_LOG is not set.
    #[arg(short = 'v', long, env = "WEFT_VERBOSITY", value_name = "LEVEL", default_value_t = 0)]
    verbosity: i32,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("{e} (examples: 10s, 5m, 24h)"))?;
    if d.is_zero() {
        return Err("must be more than zero".into());
    }
    Ok(d)
}

/// `--spin`: 0 (off), or a duration of at most 1 ms.
fn parse_spin(s: &str) -> Result<Duration, String> {
    if s.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    let d = humantime::parse_duration(s).map_err(|e| format!("{e} (examples: 0, 20us, 50us)"))?;
    if d > Duration::from_millis(1) {
        return Err("at most 1ms: a longer spin keeps a core busy instead of waiting".into());
    }
    Ok(d)
}

/// `--worker-slice`: 0 (the kernel's default), or 100us to 100ms (what the kernel takes).
fn parse_slice(s: &str) -> Result<Duration, String> {
    if s.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    let d = humantime::parse_duration(s).map_err(|e| format!("{e} (examples: 0, 100us, 1ms)"))?;
    if d < Duration::from_micros(100) || d > Duration::from_millis(100) {
        return Err("0, or from 100us to 100ms (the kernel's bounds)".into());
    }
    Ok(d)
}

/// `--tun-name`: [`weft::dataplane::check_tun_name`].
fn parse_tun_name(s: &str) -> Result<String, String> {
    weft::dataplane::check_tun_name(s).map(|()| s.to_owned())
}

fn parse_margin(s: &str) -> Result<Duration, String> {
    match s.parse::<u64>() {
        Ok(0) => Err("must be more than zero".into()),
        Ok(minutes) => Ok(Duration::from_secs(minutes * 60)),
        Err(_) => parse_duration(s),
    }
}

impl EtcdArgs {
    /// The options, with the password read from `--etcd-password-file` if given; `warn` is
    /// told about a password file others may read.
    fn options(&self, warn: impl FnOnce(String)) -> anyhow::Result<EtcdOptions> {
        let password = match (&self.etcd_password, &self.etcd_password_file) {
            (_, Some(path)) => {
                let file = secret_file::read(path).context("reading --etcd-password-file")?;
                if let Some(mode) = file.readable_by_others {
                    warn(format!(
                        "the etcd password file {} may be read by its group or others (mode \
                         {mode:04o}): make it 0600 (chmod go-rw), or keep it where only weft's \
                         user can reach it",
                        path.display()
                    ));
                }
                Some(file.secret)
            }
            (password, None) => password.clone(),
        };
        Ok(EtcdOptions {
            endpoints: self.etcd_endpoints.clone(),
            prefix: self.etcd_prefix.trim_end_matches('/').to_string(),
            ca_file: self.etcd_cafile.clone(),
            cert_file: self.etcd_certfile.clone(),
            key_file: self.etcd_keyfile.clone(),
            username: self.etcd_username.clone(),
            password: password.map(|p| p.expose().to_owned()),
            call_timeout: self.etcd_timeout,
        })
    }

    /// Connects, for the admin commands (a warning goes to stderr).
    async fn connect(&self) -> anyhow::Result<EtcdStore> {
        let options = self.options(|w| tell!("weft: warning: {w}"))?;
        self.connect_with(options).await
    }

    async fn connect_with(&self, options: EtcdOptions) -> anyhow::Result<EtcdStore> {
        EtcdStore::connect(options)
            .await
            .with_context(|| format!("connecting to etcd at {}", self.etcd_endpoints.join(",")))
    }
}

/// How long after `SIGTERM` weft exits at once should its clean stop not have finished (the
/// clean stop's own store calls are bounded well below this).
const STOP_DEADLINE: Duration = Duration::from_secs(15);

fn main() -> ExitCode {
    let (cli, notices) = match parse_command_line() {
        Ok(parsed) => parsed,
        Err(code) => return code,
    };
    match cli.command {
        Command::Run(args) => run_daemon(*args, &notices),
        command => {
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => return fail(&anyhow::Error::from(e).context("starting the runtime")),
            };
            match runtime.block_on(real_main(command)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => fail(&e),
            }
        }
    }
}

/// The command line, read as flanneld reads its own when it is one
/// ([`weft::cli::flanneld_args`]), then by clap; what to log about it once logging is up. A
/// command line either refuses exits 2 after saying why, as clap's usage errors do.
fn parse_command_line() -> Result<(Cli, Vec<Notice>), ExitCode> {
    let command = <Cli as clap::CommandFactory>::command();
    let run = command.find_subcommand("run").expect("weft run is defined");
    let weft: Vec<WeftFlag<'_>> = run
        .get_arguments()
        .filter_map(|a| {
            Some(WeftFlag { long: a.get_long()?, takes_value: a.get_action().takes_values() })
        })
        .collect();
    let args = std::env::args_os().collect();
    let normalized = match flanneld_args::normalize(args, &weft, &|k| std::env::var_os(k)) {
        Ok(n) => n,
        Err(e) => {
            tell!("weft: error: {e}");
            return Err(ExitCode::from(2));
        }
    };
    let cli = Cli::parse_from(normalized.args);
    Ok((cli, normalized.notices))
}

/// Prints `weft: error: …` on stderr (ignoring a stderr that is gone) and fails.
fn fail(e: &anyhow::Error) -> ExitCode {
    let _ = writeln!(std::io::stderr(), "weft: error: {e:#}");
    ExitCode::FAILURE
}

/// `weft run`: logs through the log queue, signals on their own thread, every panic a stop
/// (see [`weft::stop`]); exits 0 after a clean stop, non-zero after an error or a panic.
fn run_daemon(args: RunArgs, notices: &[Notice]) -> ExitCode {
    // Before the first thread (the log queue's) starts: every thread inherits the mask.
    if let Err(e) = weft::stop::block_signals() {
        return fail(&anyhow::Error::from(e).context("blocking the signals weft takes"));
    }
    let default_filter = if args.verbosity >= 1 { "weft=debug,info" } else { "info" };
    logging::init_with_default(args.log_format == "json", default_filter);
    for notice in notices {
        match notice.level {
            Level::Info => tracing::info!("{}", notice.text),
            Level::Warn => tracing::warn!("{}", notice.text),
        }
    }
    match weft::capabilities::raise_permitted() {
        Ok(raised) if !raised.is_empty() => {
            tracing::info!(
                ?raised,
                "raised the capabilities the binary permits (file capabilities)"
            );
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "could not raise the permitted capabilities"),
    }
    weft::rlimit::raise_nofile_limit();
    let stop = Stop::new();
    stop.install_panic_hook();
    let result = run_with(args, &stop);
    // The log's last lines before the error line.
    logging::flush(Duration::from_secs(1));
    match result {
        Ok(()) if stop.panicked() => {
            fail(&anyhow::anyhow!("a task panicked (see the log above); weft stopped"))
        }
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

fn run_with(args: RunArgs, stop: &Arc<Stop>) -> anyhow::Result<()> {
    if let Some(m) = args.subnet_lease_renew_margin
        && m >= args.subnet_lease_ttl
    {
        bail!(
            "--subnet-lease-renew-margin ({}) must be shorter than --subnet-lease-ttl ({})",
            humantime::format_duration(m),
            humantime::format_duration(args.subnet_lease_ttl)
        );
    }
    stop.spawn_signal_thread(STOP_DEADLINE).context("installing the signal handlers")?;
    let runtime = tokio::runtime::Runtime::new().context("starting the runtime")?;
    // Read before the runtime starts: a bad password file stops the start with its error.
    let etcd_options = args.etcd.options(|w| tracing::warn!("{w}"))?;
    let candidates = Candidates {
        ifaces: args.iface.clone(),
        regexes: args.iface_regex.clone(),
        can_reach: args.iface_can_reach,
    };
    let iface = iface::resolve(&candidates)?;
    let stop2 = stop.clone();
    // The daemon runs as a task of its own, so that a panic anywhere in it comes back here as
    // an error (after the panic hook asked every other task to stop) instead of unwinding
    // through the runtime.
    let result = runtime.block_on(async move {
        let opts = run_options(&args, iface);
        let etcd = args.etcd.clone();
        let connect: daemon::StoreConnect = Box::pin(async move {
            Ok(Arc::new(etcd.connect_with(etcd_options).await?)
                as Arc<dyn weft::lease::store::Store>)
        });
        let daemon = if args.kube_subnet_mgr {
            let kube = daemon::kube::KubeMode {
                api: weft::lease::kube::api::KubeSettings {
                    kubeconfig: args.kubeconfig_file.clone(),
                    api_url: args.kube_api_url.clone().filter(|u| !u.is_empty()),
                },
                annotation_prefix: args.kube_annotation_prefix.clone(),
                net_config_path: args.net_config_path.clone(),
            };
            tokio::spawn(daemon::kube::run(opts, kube, stop2))
        } else {
            tokio::spawn(daemon::run(opts, connect, stop2))
        };
        match daemon.await {
            Ok(result) => result,
            Err(e) => Err(anyhow::anyhow!("the daemon task ended: {e}")),
        }
    });
    // Blocking calls still running (a netlink request, a hook's wait) do not hold the exit.
    runtime.shutdown_timeout(Duration::from_secs(2));
    result
}

/// The daemon's options from the flags and the underlay interface chosen from them.
fn run_options(args: &RunArgs, iface: Option<String>) -> RunOptions {
    RunOptions {
        etcd_endpoints: args.etcd.etcd_endpoints.clone(),
        iface,
        public_ip: args.public_ip,
        public_ipv6: args.public_ipv6,
        subnet_file: args.subnet_file.clone(),
        state_dir: args.state_dir.clone(),
        wireguard_key_file: args.wireguard_key_file.clone(),
        lease_ttl: args.subnet_lease_ttl,
        renew_margin: args.subnet_lease_renew_margin,
        healthz_ip: args.healthz_ip,
        healthz_port: args.healthz_port,
        healthz_idle_timeout: args.healthz_idle_timeout,
        on_subnet_change: args.on_subnet_change.clone(),
        on_lease_lost: args.on_lease_lost.clone(),
        hook_timeout: args.hook_timeout,
        relinquish_on_exit: args.relinquish_on_exit,
        ip_masq: args.ip_masq,
        ip_masq_random_fully: args.ip_masq_random_fully,
        iptables_forward_rules: args.iptables_forward_rules,
        iptables_resync: Duration::from_secs(args.iptables_resync),
        dataplane: args.dataplane,
        tun_name: args.tun_name.clone(),
        workers: args.workers.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        }),
        tun_offload: if args.no_tun_offload { OffloadMode::Off } else { args.tun_offload },
        udp_gso: if args.no_udp_gso { OffloadMode::Off } else { args.udp_gso },
        gso_retry_after: args.gso_retry_after,
        gso_never_equal_tail: args.gso_never_equal_tail,
        udp_gro: if args.no_udp_gro { OffloadMode::Off } else { args.udp_gro },
        batching: !args.no_batching,
        one_thread: args.worker_threads == 1,
        spin: args.spin,
        worker_slice: args.worker_slice,
        netlink_resync: args.netlink_resync,
        stale_route_ttl: args.stale_route_ttl,
        takeover: args.takeover,
        exec: daemon::ExecSelf::of_this_process(),
    }
}

async fn real_main(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Run(_) => bail!("weft run is not a command of this runtime"),
        Command::PackageFiles { dir } => package_files(&dir),
        Command::Network { command: NetworkCommand::Get(etcd) } => {
            let store = etcd.connect().await?;
            let Some(raw) = store.config().await? else {
                bail!("no network config at {}", KeyLayout::new(store.prefix()).config());
            };
            say!("{}", String::from_utf8_lossy(&raw).trim_end());
            if let Err(e) = NetworkConfig::parse(&raw) {
                tell!("weft: warning: the stored config is invalid: {e}");
            }
            Ok(())
        }
        Command::Network { command: NetworkCommand::Set { file, etcd } } => {
            let mut raw = Vec::new();
            if file == "-" {
                std::io::stdin().read_to_end(&mut raw).context("reading the config from stdin")?;
            } else {
                raw = std::fs::read(&file).with_context(|| format!("reading {file}"))?;
            }
            let cfg =
                NetworkConfig::parse(&raw).context("invalid network config; nothing written")?;
            // Hosts check their own public IPs at start; here, the etcd endpoints in use.
            cfg.check_underlay(&daemon::etcd_endpoint_addrs(&etcd.etcd_endpoints))
                .context("nothing written")?;
            let store = etcd.connect().await?;
            store.set_config(&raw).await?;
            if let Some(notice) = daemon::udp_ipv6_notice(&cfg) {
                tell!("weft: note: {notice}");
            }
            let (network, subnet_len) = cfg.leased_network();
            let family = if cfg.leases_ipv4() { "" } else { " (IPv6-only)" };
            tell!(
                "network config written: {network}{family} split into /{subnet_len} subnets ({} \
                 leasable), backend {}",
                cfg.subnet_count(),
                cfg.backend.kind.as_str()
            );
            Ok(())
        }
        Command::Lease { command: LeaseCommand::List { json, etcd } } => {
            let store = etcd.connect().await?;
            lease_list(&store, json).await.with_context(|| {
                format!("listing the leases in etcd at {}", etcd.etcd_endpoints.join(","))
            })
        }
        Command::Lease { command: LeaseCommand::Revoke { subnet, etcd } } => {
            let store = etcd.connect().await?;
            let revoked = store.revoke(subnet).await.with_context(|| {
                format!("revoking {subnet} in etcd at {}", etcd.etcd_endpoints.join(","))
            })?;
            if revoked {
                tell!("revoked the lease on {subnet}");
                Ok(())
            } else {
                bail!("no lease on {subnet}")
            }
        }
    }
}

async fn lease_list(store: &EtcdStore, json: bool) -> anyhow::Result<()> {
    let listing = store.list().await?;
    // Which keys are leases depends on the network: without a valid config, show them all.
    let config = store.config().await?.and_then(|raw| NetworkConfig::parse(&raw).ok());
    let mut rows = Vec::new();
    // Keys under subnets/ that hosts ignore (not a lease of this network, or unreadable), and
    // other skipped entries (history).
    let mut ignored = Vec::new();
    let mut skipped = Vec::new();
    for b in &listing.skipped {
        match b.subnet_key() {
            Some(_) => ignored.push((b.key.clone(), b.problem.clone())),
            None => skipped.push((b.key.clone(), b.problem.clone())),
        }
    }
    for l in &listing.leases {
        if let Some(Err(e)) = config.as_ref().map(|c| c.check_lease(l.subnet)) {
            ignored.push((keys::relative_subnet_key(&l.subnet.key_name()), e.to_string()));
            continue;
        }
        let ttl = store.lease_ttl(l.lease_id).await.ok().flatten();
        let history = listing
            .history
            .iter()
            .find(|h| h.subnet == l.subnet)
            .map(|h| history_text(h.record.state));
        rows.push(serde_json::json!({
            "subnet": l.subnet.to_string(),
            "ipv6_subnet": l.ipv6.map(|h| h.to_string()),
            "public_ip": l.attrs.public_ip.to_string(),
            "holder": l.attrs.node_id.as_ref().map(|n| n.to_string()),
            "backend": l.attrs.backend_type.clone().unwrap_or_else(|| "udp".into()),
            "ttl_seconds": ttl.map(|d| d.as_secs()),
            "history": history.unwrap_or("none"),
            "live": true,
        }));
    }
    // Keys whose IPv6 half another key holds, by the route watchers' own rule (the key
    // created first keeps it): what every node routes over IPv4 only.
    let half_conflicts: Vec<(String, String)> = match config.as_ref().filter(|c| c.ipv6.is_some()) {
        Some(c) => {
            let (network, subnet_len) = c.leased_network();
            let mut set = weft::route::RouteSet::new(network, subnet_len);
            set.apply_listing(&listing);
            set.half_conflicts().iter().map(|(k, why)| (k.clone(), why.clone())).collect()
        }
        None => Vec::new(),
    };
    for h in &listing.history {
        if listing.leases.iter().any(|l| l.subnet == h.subnet) {
            continue;
        }
        rows.push(serde_json::json!({
            "subnet": h.subnet.to_string(),
            "ipv6_subnet": h.record.ipv6.map(|h| h.to_string()),
            "public_ip": h.record.public_ip.to_string(),
            "holder": h.record.node.to_string(),
            "backend": serde_json::Value::Null,
            "ttl_seconds": serde_json::Value::Null,
            "history": match h.record.state {
                HistoryState::Held => "expired",
                HistoryState::Relinquished => "relinquished",
                HistoryState::Revoked => "revoked",
            },
            "live": false,
        }));
    }
    if json {
        let out = serde_json::json!({
            "revision": listing.revision.0,
            "leases": rows,
            "ignored": ignored.iter().map(|(key, why)| serde_json::json!({"key": key, "reason": why})).collect::<Vec<_>>(),
            "skipped": skipped.iter().map(|(key, why)| serde_json::json!({"key": key, "problem": why})).collect::<Vec<_>>(),
            "ipv6_half_conflicts": half_conflicts.iter().map(|(key, why)| serde_json::json!({"key": key, "reason": why})).collect::<Vec<_>>(),
        });
        say!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    // The IPv6 column only on a dual-stack network (some lease has a half).
    let dual = rows.iter().any(|r| r["ipv6_subnet"].is_string());
    let ipv6_col = |r: &serde_json::Value| {
        if dual {
            format!("{:<24} ", r["ipv6_subnet"].as_str().unwrap_or("-"))
        } else {
            String::new()
        }
    };
    say!(
        "{:<18} {}{:<16} {:<34} {:>9}  {:<13} HISTORY",
        "SUBNET",
        if dual { format!("{:<24} ", "IPV6-SUBNET") } else { String::new() },
        "PUBLIC-IP",
        "HOLDER",
        "TTL-LEFT",
        "STATE"
    );
    for r in &rows {
        let ttl = match (r["live"].as_bool(), r["ttl_seconds"].as_u64()) {
            (Some(true), Some(s)) => format!("{s}s"),
            (Some(true), None) => "no-ttl".into(),
            _ => "-".into(),
        };
        say!(
            "{:<18} {}{:<16} {:<34} {:>9}  {:<13} {}",
            r["subnet"].as_str().unwrap_or(""),
            ipv6_col(r),
            r["public_ip"].as_str().unwrap_or(""),
            r["holder"].as_str().unwrap_or("(flannel)"),
            ttl,
            if r["live"].as_bool() == Some(true) { "live" } else { "free" },
            r["history"].as_str().unwrap_or(""),
        );
    }
    for (key, why) in &half_conflicts {
        say!("routed over IPv4 only: {key}: {why}");
    }
    for (key, why) in &ignored {
        say!("ignored: {key}: {why}");
    }
    for (key, why) in &skipped {
        tell!("weft: warning: skipped {key}: {why}");
    }
    Ok(())
}

/// `weft package-files DIR` (see [`Command::PackageFiles`]).
fn package_files(dir: &std::path::Path) -> anyhow::Result<()> {
    /// Without clap's `help` subcommands, which would each get a page of their own.
    fn without_help(command: clap::Command) -> clap::Command {
        command.disable_help_subcommand(true).mut_subcommands(without_help)
    }
    let mut command = without_help(<Cli as clap::CommandFactory>::command());
    command.build();
    let man = dir.join("man");
    std::fs::create_dir_all(&man).with_context(|| format!("creating {}", man.display()))?;
    clap_mangen::generate_to(command.clone(), &man)
        .with_context(|| format!("writing the man pages into {}", man.display()))?;
    let completions = dir.join("completions");
    std::fs::create_dir_all(&completions)
        .with_context(|| format!("creating {}", completions.display()))?;
    for shell in [clap_complete::Shell::Bash, clap_complete::Shell::Zsh, clap_complete::Shell::Fish]
    {
        clap_complete::generate_to(shell, &mut command, "weft", &completions)
            .with_context(|| format!("writing the {shell} completions"))?;
    }
    let default = dir.join("default");
    std::fs::create_dir_all(&default).with_context(|| format!("creating {}", default.display()))?;
    let env_file = default.join("weft");
    std::fs::write(&env_file, default_env_file(&command))
        .with_context(|| format!("writing {}", env_file.display()))?;
    Ok(())
}

/// `/etc/default/weft`: every shown `weft run` flag's `WEFT_*` variable, commented out with
/// its default (what weft does without it), under the flag's help.
fn default_env_file(command: &clap::Command) -> String {
    let mut out = String::from(
        "# The environment of weft.service (its EnvironmentFile=): one variable for each `weft run`\n\
         # flag, WEFT_* or flannel's own name where flannel reads one (see `weft run --help` and\n\
         # weft-run(1)); a flag on the command line\n\
         # wins over its variable. Uncomment and set what this host needs, then\n\
         # `systemctl restart weft`. This file is 0600: it may hold WEFT_ETCD_PASSWORD, though\n\
         # WEFT_ETCD_PASSWORD_FILE (a file of its own) is better.\n",
    );
    let run = command.find_subcommand("run").expect("weft run is defined");
    for arg in run.get_arguments().filter(|a| !a.is_hide_set()) {
        let (Some(env), Some(long)) = (arg.get_env(), arg.get_long()) else { continue };
        out.push('\n');
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        let mut line = format!("# --{long}:");
        for word in help.split_whitespace() {
            if line.len() + 1 + word.len() > 96 {
                out.push_str(&line);
                out.push('\n');
                line = "#".to_owned();
            }
            line.push(' ');
            line.push_str(word);
        }
        out.push_str(&line);
        out.push('\n');
        let default: Vec<String> =
            arg.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
        out.push_str(&format!("#{}={}\n", env.to_string_lossy(), default.join(",")));
    }
    out
}

fn history_text(s: HistoryState) -> &'static str {
    match s {
        HistoryState::Held => "held",
        HistoryState::Relinquished => "relinquished",
        HistoryState::Revoked => "revoked",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--etcd-password` says where its value shows; it and `--etcd-password-file` exclude each
    /// other; the parsed flags' `Debug` (a panic message, a log line) never shows the password;
    /// the file's password is the one used.
    #[test]
    fn the_etcd_password_flags_warn_exclude_each_other_and_never_show_the_password() {
        let mut cmd = <Cli as clap::CommandFactory>::command();
        let run = cmd.find_subcommand_mut("run").expect("run");
        let help = run.render_long_help().to_string();
        assert!(help.contains("/proc/<pid>/cmdline") && help.contains("--etcd-password-file"));
        let both = Cli::try_parse_from([
            "weft",
            "run",
            "--etcd-password",
            "hunter2",
            "--etcd-password-file",
            "/p",
        ]);
        let err = both.map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("cannot be used with"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
        let cli = Cli::try_parse_from(["weft", "run", "--etcd-password", "hunter2"]).unwrap();
        assert!(!format!("{cli:?}").contains("hunter2"), "{cli:?}");
        let Command::Run(run) = cli.command else { panic!("run") };
        let opts = run.etcd.options(|_| ()).unwrap();
        assert_eq!(opts.password.as_deref(), Some("hunter2"));
        assert!(!format!("{opts:?}").contains("hunter2"));

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        std::fs::write(&file, "from-the-file\n").unwrap();
        std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o644))
            .unwrap();
        let path = file.to_str().unwrap();
        let cli =
            Cli::try_parse_from(["weft", "lease", "list", "--etcd-password-file", path]).unwrap();
        let Command::Lease { command: LeaseCommand::List { etcd, .. } } = cli.command else {
            panic!("lease list")
        };
        let mut warnings = Vec::new();
        let opts = etcd.options(|w| warnings.push(w)).unwrap();
        assert_eq!(opts.password.as_deref(), Some("from-the-file"));
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains(path) && warnings[0].contains("0644"), "{warnings:?}");
        std::fs::write(&file, "").unwrap();
        let err = format!("{:#}", etcd.options(|_| ()).unwrap_err());
        assert!(err.contains("--etcd-password-file") && err.contains(path), "{err}");
    }

    /// `--tun-name` takes the one name of one device: a kernel template (`weft%d`, which names
    /// one device per queue) and names the kernel would refuse are refused at parsing, with
    /// the flag named and why.
    #[test]
    fn tun_name_templates_and_names_the_kernel_refuses_are_refused_at_parsing() {
        let parse = |name: &str| Cli::try_parse_from(["weft", "run", "--tun-name", name]);
        for name in ["weft0", "flannel.1", "w", "exactly-15-byte", "weft_tun-0"] {
            let args = parse(name);
            let Ok(Cli { command: Command::Run(run), .. }) = args else {
                panic!("{name}: {args:?}")
            };
            assert_eq!(run.tun_name, name);
        }
        for (name, why) in [
            ("weft%d", "template"),
            ("weft%", "template"),
            ("", "1 to 15 bytes"),
            ("sixteen-bytes-00", "1 to 15 bytes"),
            (".", "\".\""),
            ("..", "\"..\""),
            ("a/b", "'/'"),
            ("a:1", "':'"),
            ("weft 0", "whitespace"),
            ("weft\t0", "whitespace"),
            ("wéft0", "ASCII"),
        ] {
            let err = match parse(name) {
                Ok(cli) => panic!("{name:?} accepted: {cli:?}"),
                Err(e) => e.to_string(),
            };
            assert!(err.contains("--tun-name") && err.contains(why), "{name:?}: {err}");
        }
        let Ok(Cli { command: Command::Run(run), .. }) = Cli::try_parse_from(["weft", "run"])
        else {
            panic!("weft run")
        };
        assert_eq!(run.tun_name, "weft0");
    }

    #[test]
    fn offload_flags_are_auto_on_off_and_the_old_no_flags_mean_off() {
        let run = |extra: &[&str]| {
            let mut argv = vec!["weft", "run"];
            argv.extend_from_slice(extra);
            match Cli::try_parse_from(argv) {
                Ok(Cli { command: Command::Run(run) }) => Ok(run_options(&run, None)),
                Ok(other) => panic!("{other:?}"),
                Err(e) => Err(e.to_string()),
            }
        };
        let o = run(&[]).unwrap();
        assert_eq!(
            (o.udp_gso, o.udp_gro, o.tun_offload),
            (OffloadMode::Auto, OffloadMode::Auto, OffloadMode::Auto)
        );
        let o = run(&["--udp-gso", "on", "--no-udp-gro", "--tun-offload", "off"]).unwrap();
        assert_eq!(
            (o.udp_gso, o.udp_gro, o.tun_offload),
            (OffloadMode::On, OffloadMode::Off, OffloadMode::Off)
        );
        assert_eq!(run(&["--no-udp-gso"]).unwrap().udp_gso, OffloadMode::Off);
        let e = run(&["--no-udp-gso", "--udp-gso", "on"]).unwrap_err();
        assert!(e.contains("cannot be used with"), "{e}");
        assert!(run(&["--udp-gso", "maybe"]).unwrap_err().contains("auto"));
        // The hidden switch benchmarks use: the equal-tail workaround whatever the kernel.
        assert!(!run(&[]).unwrap().gso_never_equal_tail);
        assert!(run(&["--gso-never-equal-tail"]).unwrap().gso_never_equal_tail);
    }

    #[test]
    fn spin_is_off_at_zero_and_at_most_a_millisecond() {
        assert_eq!(parse_spin("0"), Ok(Duration::ZERO));
        assert_eq!(parse_spin("50us"), Ok(Duration::from_micros(50)));
        assert_eq!(parse_spin("1ms"), Ok(Duration::from_millis(1)));
        assert!(parse_spin("2ms").unwrap_err().contains("at most 1ms"));
        assert!(parse_spin("fast").unwrap_err().contains("examples"));
        let args = Cli::try_parse_from(["weft", "run"]);
        let Ok(Cli { command: Command::Run(run), .. }) = args else { panic!("{args:?}") };
        assert_eq!(run.spin, Duration::ZERO, "off unless asked for");
    }

    fn run_command() -> clap::Command {
        let mut command = <Cli as clap::CommandFactory>::command();
        command.build();
        command.find_subcommand("run").expect("run").clone()
    }

    fn weft_flags(run: &clap::Command) -> Vec<(String, bool)> {
        run.get_arguments()
            .filter_map(|a| Some((a.get_long()?.to_owned(), a.get_action().takes_values())))
            .collect()
    }

    /// A command line through the flanneld reading, then clap's.
    fn parse_as_weft(line: &[&str]) -> Result<Cli, String> {
        let run = run_command();
        let flags = weft_flags(&run);
        let weft: Vec<WeftFlag<'_>> =
            flags.iter().map(|(l, v)| WeftFlag { long: l, takes_value: *v }).collect();
        let args = line.iter().map(std::ffi::OsString::from).collect();
        let n = flanneld_args::normalize(args, &weft, &|_| None).map_err(|e| e.to_string())?;
        Cli::try_parse_from(n.args).map_err(|e| e.to_string())
    }

    /// Every flanneld flag that becomes a weft flag names one `weft run` has, and a bool one a
    /// switch, a valued one a flag with a value.
    #[test]
    fn every_flanneld_flag_weft_takes_is_a_weft_run_flag_of_the_same_kind() {
        use flanneld_args::{Becomes, FLANNELD_FLAGS, Kind};
        let flags = weft_flags(&run_command());
        for f in FLANNELD_FLAGS {
            let (name, valued) = match f.becomes {
                Becomes::Weft(name) => (name, f.kind != Kind::Bool),
                // A bool given as a value: `--name=true|false`.
                Becomes::WeftBool(name) | Becomes::WeftNot(name) => (name, true),
                _ => continue,
            };
            let Some((_, takes_value)) = flags.iter().find(|(l, _)| l == name) else {
                panic!("flanneld's -{} becomes --{name}, which weft run does not have", f.name)
            };
            assert_eq!(*takes_value, valued, "-{} vs --{name}", f.name);
        }
    }

    /// A flanneld unit's ExecStart line (Fedora's and CentOS's flannel package, its
    /// /etc/sysconfig/flanneld filled in as systemd expands it) means what it meant.
    #[test]
    fn a_flanneld_unit_line_parses_with_its_meaning() {
        let line = [
            "/usr/bin/weft",
            "-etcd-endpoints=http://192.0.2.254:2379,http://192.0.2.253:2379",
            "-etcd-prefix=/atomic.io/network",
            "-iface=eth1",
            "--iface",
            "eth0",
            "-iface-regex=^ens[0-9]+",
            "-ip-masq=true",
            "-subnet-lease-renew-margin=30",
            "-v",
            "2",
            "-public-ip=",
            "-healthz-port=9797",
        ];
        let cli = parse_as_weft(&line).unwrap();
        let Command::Run(run) = cli.command else { panic!("not weft run") };
        assert_eq!(
            run.etcd.etcd_endpoints,
            ["http://192.0.2.254:2379", "http://192.0.2.253:2379"].map(String::from)
        );
        assert_eq!(run.etcd.etcd_prefix, "/atomic.io/network");
        assert_eq!(run.iface, ["eth1", "eth0"].map(String::from));
        assert_eq!(run.iface_regex.iter().map(|r| r.as_str()).collect::<Vec<_>>(), ["^ens[0-9]+"]);
        assert!(run.ip_masq);
        assert_eq!(run.subnet_lease_renew_margin, Some(Duration::from_secs(30 * 60)));
        assert_eq!(run.verbosity, 2);
        assert_eq!(run.public_ip, None);
        assert_eq!(run.healthz_port, 9797);
        // weft's own flags keep working, with one dash or two.
        let cli = parse_as_weft(&["weft", "run", "-tun-name=w1", "--relinquish-on-exit"]).unwrap();
        let Command::Run(run) = cli.command else { panic!("not weft run") };
        assert_eq!(run.tun_name, "w1");
        assert!(run.relinquish_on_exit);
        // kube-flannel's command line: the Kubernetes subnet manager.
        let cli = parse_as_weft(&["weft", "-kube-subnet-mgr", "-kube-api-url=https://k"]).unwrap();
        let Command::Run(run) = cli.command else { panic!("not weft run") };
        assert!(run.kube_subnet_mgr);
        assert_eq!(run.kube_api_url.as_deref(), Some("https://k"));
    }

    /// The environment file lists every shown `weft run` flag's variable once, commented out,
    /// with a default that flag's parser takes; no hidden flag's.
    #[test]
    fn the_default_environment_file_has_every_flag_variable_with_a_valid_default() {
        let mut command = <Cli as clap::CommandFactory>::command();
        command.build();
        let text = default_env_file(&command);
        let run = command.find_subcommand("run").expect("run");
        let assignments: Vec<(&str, &str)> = text
            .lines()
            .filter_map(|l| l.strip_prefix('#')?.split_once('='))
            .filter(|(name, _)| {
                !name.is_empty()
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
            })
            .collect();
        let shown: Vec<&clap::Arg> =
            run.get_arguments().filter(|a| !a.is_hide_set() && a.get_env().is_some()).collect();
        assert_eq!(assignments.len(), shown.len(), "{text}");
        for arg in shown {
            let env = arg.get_env().unwrap().to_str().unwrap();
            let found: Vec<_> = assignments.iter().filter(|(n, _)| *n == env).collect();
            assert_eq!(found.len(), 1, "{env} in:\n{text}");
            let value = found[0].1;
            if arg.get_action().takes_values() && !value.is_empty() {
                let flag = format!("--{}={value}", arg.get_long().unwrap());
                run.clone()
                    .try_get_matches_from(["run", &flag])
                    .unwrap_or_else(|e| panic!("{env}={value}: {e}"));
            }
        }
        for hidden in run.get_arguments().filter(|a| a.is_hide_set()) {
            let env = hidden.get_env().unwrap().to_str().unwrap();
            assert!(!text.contains(&format!("#{env}=")), "hidden {env} listed");
        }
        assert!(text.contains("#WEFT_ETCD_ENDPOINTS=http://127.0.0.1:2379\n"), "{text}");
        assert!(text.contains("#WEFT_IP_MASQ=false\n"), "{text}");
    }
}
