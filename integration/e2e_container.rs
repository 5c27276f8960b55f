//! weft as users get it: the OCI image and the Debian package that `scripts/package.sh` builds
//! (into `<target>/package/`; `WEFT_OCI_IMAGE` and `WEFT_DEB` name other files).
//!
//! - The image, loaded into a real podman and run as three containers, each in a namespace
//!   host of the lab (`--network ns:/run/netns/<host>`), with every capability dropped but
//!   `CAP_NET_ADMIN` and `/dev/net/tun` passed in: two as container root (one given weft's
//!   flags, one flanneld's), one as uid 65534. Each leases a subnet, writes `subnet.env` into
//!   the host directory mounted at `/run/flannel`, and pods behind the three hosts ping each
//!   other across the overlay; `podman stop` ends each with status 0.
//! - The package: its files, modes, conffile and `Depends`, and its unit checked by
//!   `systemd-analyze verify`; then installed with `dpkg -i` and started for real by systemd
//!   running as the init of a container (the machine's own root, overlaid, so that nothing is
//!   pulled or bootstrapped, and nothing it writes outlives the container), in a namespace
//!   host: it leases as its dynamic user with only `CAP_NET_ADMIN`, `systemctl reload` leaves
//!   it running, `systemctl stop` ends it cleanly, and a restart keeps its subnet.
//!
//! podman runs with storage of its own (vfs, in a temp dir: the machine's images and
//! containers are never touched), `runc`, the `cgroupfs` manager and no default ulimits (a
//! `CONTAINERS_CONF` file of the test's): what works on a host with a hybrid cgroup layout,
//! where `crun` fails, as on a unified one. The non-root container gets the host's
//! `/dev/net/tun` when its mode lets others open it (0666, as on most distributions), else a
//! 0666 node of the lab's own with the same device number, as the lab's non-root host does.
//!
//! Needs root, podman and runc (`scripts/setup.sh`); built with the `container` feature.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use support::netns::{Families, Lab, Pod, in_netns, output, ping_all_pairs, run};
use support::process::run_command;
use support::weft::http_get;

const VXLAN: &str = r#"{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"vxlan"}}"#;
const ETCD: &str = "http://192.0.2.254:2379";
const HEALTH: u16 = 9797;
const IMAGE: &str = concat!("localhost/weft:", env!("CARGO_PKG_VERSION"));

/// `<target>/package/`, where scripts/package.sh writes (the test's own weft is
/// `<target>/debug/weft`).
fn package_dir() -> PathBuf {
    let bin = Path::new(env!("CARGO_BIN_EXE_weft"));
    bin.parent().and_then(Path::parent).expect("<target>/debug/weft").join("package")
}

/// The artifact `var` names, else `name` in [`package_dir`]; panics, saying how to make it,
/// when it is missing.
fn artifact(var: &str, name: &str) -> PathBuf {
    let path = std::env::var_os(var).map_or_else(|| package_dir().join(name), PathBuf::from);
    assert!(
        path.is_file(),
        "{} is missing: run scripts/package.sh first (or set {var})",
        path.display()
    );
    path
}

/// A podman of the test's own: its storage, run root and config in a temp dir. Dropping it
/// removes every container it started.
struct Podman {
    dir: tempfile::TempDir,
    names: Vec<String>,
}

impl Podman {
    fn new() -> Self {
        for tool in ["podman", "runc"] {
            assert!(
                output(&["sh", "-c", &format!("command -v {tool}")]).status.success(),
                "{tool} is missing (Debian: podman runc; or run scripts/setup.sh)"
            );
        }
        let dir = tempfile::Builder::new().prefix("weft-podman-").tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("containers.conf"),
            "[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = \"runc\"\n\
             cgroup_manager = \"cgroupfs\"\nevents_logger = \"none\"\n",
        )
        .expect("containers.conf");
        Self { dir, names: Vec::new() }
    }

    fn command(&self, args: &[&str]) -> Command {
        let d = self.dir.path();
        let mut cmd = Command::new("podman");
        cmd.arg("--root")
            .arg(d.join("storage"))
            .arg("--runroot")
            .arg(d.join("run"))
            .args(["--storage-driver", "vfs"])
            .args(args)
            .env("CONTAINERS_CONF", d.join("containers.conf"))
            .stdin(Stdio::null());
        cmd
    }

    fn output(&self, args: &[&str]) -> Output {
        self.command(args).output().unwrap_or_else(|e| panic!("podman {args:?}: {e}"))
    }

    /// `podman ARGS`, which must succeed; its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.output(args);
        assert!(
            out.status.success(),
            "podman {args:?} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `podman run -d --name NAME REST` (options, the image, its arguments).
    fn run(&mut self, name: &str, rest: &[&str]) {
        self.names.push(name.to_owned());
        let mut all = vec!["run", "-d", "--name", name];
        all.extend_from_slice(rest);
        self.ok(&all);
    }

    /// `sh -c SCRIPT` inside the running container NAME, which must succeed; its stdout.
    fn sh(&self, name: &str, script: &str) -> String {
        run_command(&mut self.enter_command(name, &["sh", "-c", script]))
    }

    /// ARGS run inside the running container NAME; see [`Podman::enter_command`].
    fn enter(&self, name: &str, args: &[&str]) -> Output {
        let mut cmd = self.enter_command(name, args);
        cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"))
    }

    /// ARGS inside the running container NAME: in every namespace of its first process and
    /// under its root directory, with a clean environment. Not `podman exec`: under a chroot (a
    /// fresh Debian root, as CI and a new machine have) runc's exec enters the container's mount
    /// namespace but lands at that namespace's root, which is the machine's, not the container's,
    /// because a pivot_root below a chroot leaves the namespace's root where it was.
    fn enter_command(&self, name: &str, args: &[&str]) -> Command {
        let pid = self.inspect(name, "{{.State.Pid}}");
        let mut cmd = Command::new("nsenter");
        cmd.args(["--target", &pid, "--all", "--root", "--wd", "--"])
            .args([
                "env",
                "-i",
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            ])
            .args(args)
            .stdin(Stdio::null());
        cmd
    }

    fn logs(&self, name: &str) -> String {
        let out = self.output(&["logs", name]);
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    }

    fn inspect(&self, name: &str, format: &str) -> String {
        self.ok(&["inspect", "--format", format, name]).trim().to_owned()
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for name in &self.names {
                eprintln!("--- podman logs {name} ---\n{}", self.logs(name));
            }
        }
        if !self.names.is_empty() {
            let mut args = vec!["rm", "-f", "-t", "0"];
            args.extend(self.names.iter().map(String::as_str));
            let _ = self.output(&args);
        }
    }
}

/// One container's host directories, mounted at `/run/flannel` and `/var/lib/weft`.
struct Mounts {
    flannel: PathBuf,
    state: PathBuf,
}

impl Mounts {
    fn new(lab: &Lab, name: &str, uid: Option<u32>) -> Self {
        let base = lab.dir().join(name);
        let m = Self { flannel: base.join("flannel"), state: base.join("state") };
        for d in [&m.flannel, &m.state] {
            std::fs::create_dir_all(d).expect("mount dir");
            if let Some(uid) = uid {
                std::os::unix::fs::chown(d, Some(uid), Some(uid)).expect("chown mount dir");
            }
        }
        m
    }

    fn volumes(&self) -> Vec<String> {
        vec![
            "-v".into(),
            format!("{}:/run/flannel", self.flannel.display()),
            "-v".into(),
            format!("{}:/var/lib/weft", self.state.display()),
        ]
    }

    fn subnet_env(&self) -> PathBuf {
        self.flannel.join("subnet.env")
    }
}

/// Waits until the weft in `host` answers 200 on `/readyz` and `subnet.env` names a subnet;
/// returns the subnet (`10.244.3.0/24`).
fn wait_ready(podman: &Podman, name: &str, host: &str, mounts: &Mounts) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status = in_netns(host, || {
            http_get(std::net::SocketAddr::from(([127, 0, 0, 1], HEALTH)), "/readyz")
        });
        let env = std::fs::read_to_string(mounts.subnet_env()).unwrap_or_default();
        if status.0 == 200
            && let Some(subnet) = env.lines().find_map(|l| l.strip_prefix("FLANNEL_SUBNET="))
        {
            let (ip, len) = subnet.split_once('/').expect("a CIDR");
            let ip: std::net::Ipv4Addr = ip.parse().expect("an address");
            return format!("{}/{len}", std::net::Ipv4Addr::from(u32::from(ip) - 1));
        }
        assert!(
            Instant::now() < deadline,
            "{name} not ready in 30 s ({status:?}; state {}):\n{}",
            podman.inspect(name, "{{.State.Status}} {{.State.ExitCode}}"),
            podman.logs(name)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The `Uid:` and `CapEff:` lines of the container's main process, as the host sees it.
fn uid_and_caps(podman: &Podman, name: &str) -> (String, String) {
    let pid = podman.inspect(name, "{{.State.Pid}}");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let field = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .map(|v| v.split_whitespace().next().unwrap_or("").to_owned())
            .unwrap_or_default()
    };
    (field("Uid:"), field("CapEff:"))
}

/// `/dev/net/tun` for a container whose user is not root: the host's when others may open
/// it, else a 0666 node of the lab's (the host's node is left as it is).
fn tun_for_nonroot(lab: &Lab) -> PathBuf {
    let host = Path::new("/dev/net/tun");
    let mode = std::fs::metadata(host).expect("/dev/net/tun").permissions().mode();
    if mode & 0o006 == 0o006 {
        return host.to_owned();
    }
    let own = lab.dir().join("container-tun");
    run(&["mknod", &own.to_string_lossy(), "c", "10", "200"]);
    std::fs::set_permissions(&own, std::fs::Permissions::from_mode(0o666)).expect("chmod tun");
    eprintln!(
        "/dev/net/tun is {:o} here: the non-root container gets {}",
        mode & 0o777,
        own.display()
    );
    own
}

#[test]
fn the_image_runs_as_container_root_and_as_a_user_and_pods_ping_across() {
    let image = artifact("WEFT_OCI_IMAGE", concat!("weft-", env!("CARGO_PKG_VERSION"), ".oci.tar"));
    let lab = Lab::new(VXLAN);
    let mut podman = Podman::new();
    let loaded = podman.ok(&["load", "-i", &image.to_string_lossy()]);
    assert!(loaded.contains(&format!("Loaded image: {IMAGE}")), "{loaded}");
    let config = podman.ok(&["image", "inspect", "--format", "{{json .Config.Entrypoint}}", IMAGE]);
    assert_eq!(config.trim(), r#"["/usr/bin/weft"]"#);

    let nonroot_tun = tun_for_nonroot(&lab);
    // (container, host, user, tun node, weft's arguments)
    let health = HEALTH.to_string();
    let weft_style: Vec<&str> = vec![
        "run",
        "--etcd-endpoints",
        ETCD,
        "--iface",
        "eth0",
        "--healthz-ip",
        "127.0.0.1",
        "--healthz-port",
        &health,
    ];
    let flanneld_style = [
        format!("-etcd-endpoints={ETCD}"),
        "-iface=eth0".into(),
        "-healthz-ip=127.0.0.1".into(),
        format!("-healthz-port={HEALTH}"),
        "-ip-masq=false".into(),
    ];
    let flanneld_style: Vec<&str> = flanneld_style.iter().map(String::as_str).collect();
    let containers: [(u8, Option<u32>, &Path, &[&str]); 3] = [
        (1, None, Path::new("/dev/net/tun"), &weft_style),
        (2, None, Path::new("/dev/net/tun"), &flanneld_style),
        (3, Some(65534), &nonroot_tun, &weft_style),
    ];
    let mut started = Vec::new();
    for (n, uid, tun, args) in containers {
        let host = lab.host(n);
        let name = format!("{}-c{n}", lab.prefix);
        let mounts = Mounts::new(&lab, &format!("c{n}"), uid);
        let mut options: Vec<String> = vec![
            "--network".into(),
            format!("ns:/run/netns/{host}"),
            "--cap-drop".into(),
            "all".into(),
            "--cap-add".into(),
            "NET_ADMIN".into(),
            "--device".into(),
            format!("{}:/dev/net/tun", tun.display()),
            "-e".into(),
            "WEFT_LOG=weft=debug,info".into(),
        ];
        if let Some(uid) = uid {
            options.extend(["--user".into(), format!("{uid}:{uid}")]);
        }
        options.extend(mounts.volumes());
        options.push(IMAGE.into());
        let mut rest: Vec<&str> = options.iter().map(String::as_str).collect();
        rest.extend_from_slice(args);
        podman.run(&name, &rest);
        started.push((n, uid, name, host, mounts));
    }
    let mut subnets = Vec::new();
    let mut pods: Vec<Pod> = Vec::new();
    for (n, uid, name, host, mounts) in &started {
        let subnet = wait_ready(&podman, name, host, mounts);
        let (got_uid, caps) = uid_and_caps(&podman, name);
        assert_eq!(got_uid, uid.unwrap_or(0).to_string(), "{name}'s user");
        // CAP_NET_ADMIN (bit 12) and nothing else.
        assert_eq!(caps, "0000000000001000", "{name}'s effective capabilities");
        let (key, value) = lab.lease_entry(&subnet).unwrap_or_else(|| panic!("no lease {subnet}"));
        assert_eq!(value["PublicIP"], format!("192.0.2.{n}"), "{key}: {value}");
        eprintln!("{name} (uid {got_uid}) in {host}: {subnet}");
        subnets.push(subnet);
        pods.push(lab.pod(*n, &mounts.subnet_env()));
    }
    subnets.sort();
    subnets.dedup();
    assert_eq!(subnets.len(), 3, "three distinct subnets: {subnets:?}");
    ping_all_pairs(&pods, Families::V4);
    for (_, _, name, _, _) in &started {
        podman.ok(&["stop", "-t", "10", name]);
        assert_eq!(podman.inspect(name, "{{.State.ExitCode}}"), "0", "{name}'s exit status");
    }
}

#[test]
fn the_package_holds_its_files_and_its_unit_verifies() {
    let deb = artifact("WEFT_DEB", &format!("weft_{}_amd64.deb", env!("CARGO_PKG_VERSION")));
    let field = |name: &str| run(&["dpkg-deb", "-f", &deb.to_string_lossy(), name]);
    assert_eq!(field("Package").trim(), "weft");
    assert_eq!(field("Version").trim(), env!("CARGO_PKG_VERSION"));
    let depends = field("Depends");
    assert!(depends.contains("libc6 (>= "), "Depends: {depends}");
    let root = tempfile::tempdir().expect("tempdir");
    let r = root.path();
    run(&["dpkg-deb", "-x", &deb.to_string_lossy(), &r.to_string_lossy()]);
    let control = r.join("DEBIAN");
    run(&["dpkg-deb", "-e", &deb.to_string_lossy(), &control.to_string_lossy()]);
    let conffiles = std::fs::read_to_string(control.join("conffiles")).expect("conffiles");
    assert_eq!(conffiles, "/etc/default/weft\n");
    let mode = |p: &str| std::fs::metadata(r.join(p)).map(|m| m.permissions().mode() & 0o7777);
    assert_eq!(mode("usr/bin/weft").ok(), Some(0o755));
    assert_eq!(mode("etc/default/weft").ok(), Some(0o600), "it may hold the etcd password");
    for file in [
        "lib/systemd/system/weft.service",
        "usr/share/man/man1/weft.1.gz",
        "usr/share/man/man1/weft-run.1.gz",
        "usr/share/bash-completion/completions/weft",
        "usr/share/zsh/vendor-completions/_weft",
        "usr/share/fish/vendor_completions.d/weft.fish",
        "usr/share/doc/weft/copyright",
    ] {
        assert!(r.join(file).is_file(), "{file} missing from the package");
    }
    // The packaged binary runs, and its environment file names every flag's variable.
    let version = run(&[&r.join("usr/bin/weft").to_string_lossy(), "--version"]);
    assert_eq!(version.trim(), concat!("weft ", env!("CARGO_PKG_VERSION")));
    let env_file = std::fs::read_to_string(r.join("etc/default/weft")).expect("default file");
    for var in ["WEFT_ETCD_ENDPOINTS", "WEFT_IFACE", "WEFT_IFACE_REGEX", "WEFT_SUBNET_FILE"] {
        assert!(env_file.contains(&format!("\n#{var}=")), "{var} missing:\n{env_file}");
    }
    // systemd's own check of the unit, against the package's files under --root (ExecStart's
    // binary is the packaged one), with what the package leaves to the system beside them:
    // the host's units (the targets it orders itself after) and /bin/kill (ExecReload=). Man
    // pages are not looked up.
    let units = r.join("lib/systemd/system");
    for entry in std::fs::read_dir("/lib/systemd/system").expect("the host's systemd units") {
        let from = entry.expect("a unit").path();
        let to = units.join(from.file_name().expect("a name"));
        if to.exists() || from.is_dir() {
            continue;
        }
        match std::fs::read_link(&from) {
            Ok(target) => std::os::unix::fs::symlink(target, &to).expect("link a unit"),
            Err(_) => drop(std::fs::copy(&from, &to).expect("copy a unit")),
        }
    }
    std::fs::create_dir_all(r.join("bin")).expect("bin");
    std::fs::copy("/bin/kill", r.join("bin/kill")).expect("/bin/kill (procps)");
    let unit = units.join("weft.service");
    let out = output(&[
        "systemd-analyze",
        "verify",
        "--man=no",
        &format!("--root={}", r.display()),
        &unit.to_string_lossy(),
    ]);
    let said =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && said.trim().is_empty(),
        "systemd-analyze verify: {}\n{said}",
        out.status
    );
    let unit_text = std::fs::read_to_string(&unit).expect("unit");
    for line in [
        "ExecStart=/usr/bin/weft run",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "Restart=on-failure",
        "AmbientCapabilities=CAP_NET_ADMIN",
        "CapabilityBoundingSet=CAP_NET_ADMIN",
        "DeviceAllow=/dev/net/tun rw",
        "StateDirectory=weft",
        "RuntimeDirectory=flannel",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
        "RestrictAddressFamilies=AF_INET AF_INET6 AF_NETLINK AF_UNIX",
        "EnvironmentFile=-/etc/default/weft",
    ] {
        assert!(unit_text.lines().any(|l| l == line), "{line:?} not in the unit:\n{unit_text}");
    }
}

/// The `Key=value` of `systemctl show -p KEY --value UNIT` in the container.
fn unit_property(podman: &Podman, name: &str, key: &str) -> String {
    podman.sh(name, &format!("systemctl show -p {key} --value weft")).trim().to_owned()
}

/// Waits until the weft in `host` answers 200 on `/readyz` and the container's
/// /run/flannel/subnet.env names a subnet; returns that line's value.
fn wait_unit_ready(podman: &Podman, name: &str, host: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ready = in_netns(host, || {
            http_get(std::net::SocketAddr::from(([127, 0, 0, 1], HEALTH)), "/readyz").0
        });
        let env = podman.enter(name, &["cat", "/run/flannel/subnet.env"]);
        let env = String::from_utf8_lossy(&env.stdout).into_owned();
        if ready == 200
            && let Some(s) = env.lines().find_map(|l| l.strip_prefix("FLANNEL_SUBNET="))
        {
            return s.to_owned();
        }
        assert!(
            Instant::now() < deadline,
            "weft.service not ready in 30 s (/readyz {ready}):\n{}",
            podman.sh(
                name,
                "systemctl status weft --no-pager -n 0; journalctl -u weft --no-pager -n 40 -o cat"
            )
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn the_package_installs_and_its_unit_runs_under_systemd() {
    let deb = artifact("WEFT_DEB", &format!("weft_{}_amd64.deb", env!("CARGO_PKG_VERSION")));
    let deb = std::fs::canonicalize(&deb).expect("the package's path");
    assert!(Path::new("/lib/systemd/systemd").is_file(), "no systemd (Debian: systemd)");
    let lab = Lab::new(VXLAN);
    let host = lab.host(1);
    let mut podman = Podman::new();
    let name = format!("{}-systemd", lab.prefix);
    // The unit's dynamic user is not root: it needs a /dev/net/tun others may open.
    let tun = tun_for_nonroot(&lab);
    let (netns, device) =
        (format!("ns:/run/netns/{host}"), format!("{}:/dev/net/tun", tun.display()));
    podman.run(
        &name,
        &[
            "--systemd=always",
            // systemd sets each service's sandbox (ProtectSystem=, PrivateTmp=, …) up in
            // mount namespaces of its own; the unit's CAP_NET_ADMIN must be the container's
            // to give.
            "--cap-add",
            "SYS_ADMIN,NET_ADMIN",
            "--network",
            &netns,
            "--device",
            &device,
            // The overlaid root's own /tmp and /run (podman's run root among them) are not
            // copied into the container's.
            "--tmpfs",
            "/tmp:rw,notmpcopyup",
            "--tmpfs",
            "/run:rw,notmpcopyup",
            "--rootfs",
            "/:O",
            "/lib/systemd/systemd",
            "--unit=basic.target",
        ],
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = podman.enter(&name, &["systemctl", "is-system-running"]);
        let state = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if state == "running" || state == "degraded" {
            break;
        }
        assert!(Instant::now() < deadline, "systemd in the container is {state:?} after 30 s");
        std::thread::sleep(Duration::from_millis(200));
    }
    // No man-db index rebuild for one package in a throwaway root.
    podman.sh(&name, &format!("rm -f /var/lib/man-db/auto-update; dpkg -i {}", deb.display()));
    podman.sh(
        &name,
        &format!(
            "printf 'WEFT_ETCD_ENDPOINTS={ETCD}\\nWEFT_IFACE=eth0\\nWEFT_HEALTHZ_IP=127.0.0.1\\n\\
             WEFT_HEALTHZ_PORT={HEALTH}\\n' >>/etc/default/weft && systemctl start weft"
        ),
    );
    let subnet = wait_unit_ready(&podman, &name, &host);
    let pid = unit_property(&podman, &name, "MainPID");
    let status = podman.sh(&name, &format!("cat /proc/{pid}/status"));
    let field = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .map(|v| v.trim().to_owned())
            .unwrap_or_default()
    };
    let uid = field("Uid:");
    assert!(!uid.starts_with('0'), "weft.service runs as root: {uid}");
    assert_eq!(field("CapEff:"), "0000000000001000", "only CAP_NET_ADMIN");
    assert_eq!(field("CapBnd:"), "0000000000001000", "CapabilityBoundingSet=CAP_NET_ADMIN");
    assert_eq!(field("NoNewPrivs:"), "1");
    let (ip, len) = subnet.split_once('/').expect("CIDR");
    let ip: std::net::Ipv4Addr = ip.parse().expect("address");
    let leased = format!("{}/{len}", std::net::Ipv4Addr::from(u32::from(ip) - 1));
    let (key, value) = lab.lease_entry(&leased).unwrap_or_else(|| panic!("no lease {leased}"));
    assert_eq!(value["PublicIP"], "192.0.2.1", "{key}: {value}");
    eprintln!("weft.service (uid {uid}) leased {leased}");
    // Forwarding works inside the unit's sandbox: a pod behind it pings one behind a weft
    // of the lab's own, and back.
    let mut peer = lab.start_weft(2, &[]);
    peer.wait_ready(Duration::from_secs(20));
    let env = lab.dir().join("systemd-subnet.env");
    std::fs::write(&env, podman.sh(&name, "cat /run/flannel/subnet.env")).expect("subnet.env");
    let pods = [lab.pod(1, &env), lab.pod(2, &peer.subnet_file())];
    peer.wait_metric("weft_routes", Duration::from_secs(5), |v| v >= 1.0);
    ping_all_pairs(&pods, Families::V4);

    // The package upgraded over a running weft: its postinst reloads the unit, and
    // ExecReload= (SIGHUP) is an in-place upgrade inside the unit's sandbox: a bridge takes
    // everything over, weft re-executes the new binary in the same process and takes it back.
    podman.sh(&name, &format!("dpkg -i {}", deb.display()));
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let handed = "holding the lease the previous process of this node handed over";
    let journal = loop {
        let journal = podman.sh(&name, "journalctl -u weft --no-pager -o cat");
        if journal.matches(handed).count() >= 2 && journal.contains("handed over: the next weft") {
            break journal;
        }
        assert!(std::time::Instant::now() < deadline, "no in-place upgrade:\n{journal}");
        std::thread::sleep(Duration::from_millis(100));
    };
    // systemd leaves "reloading" when the new image says READY=1, once its /readyz is ready:
    // a moment after the handover is logged.
    let deadline = Instant::now() + Duration::from_secs(10);
    while unit_property(&podman, &name, "ActiveState") != "active" {
        assert!(Instant::now() < deadline, "still reloading after 10 s (no READY=1):\n{journal}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(unit_property(&podman, &name, "MainPID"), pid, "a reload restarted weft");
    ping_all_pairs(&pods, Families::V4);

    // A clean stop, then a start that finds its state and subnet.env kept.
    // Type=notify: systemd says active only after weft said READY=1, and shows its status.
    let status = unit_property(&podman, &name, "StatusText");
    assert!(status.starts_with("holding "), "StatusText={status}");
    // A crash (kill -9): Restart=on-failure starts weft again, and systemd's fd store gives
    // the new process the TUN device and sockets the old one left there.
    let crashed = unit_property(&podman, &name, "MainPID");
    podman.sh(&name, "systemctl kill -s KILL weft");
    let deadline = Instant::now() + Duration::from_secs(30);
    while unit_property(&podman, &name, "MainPID") == crashed
        || unit_property(&podman, &name, "ActiveState") != "active"
    {
        assert!(Instant::now() < deadline, "weft.service was not restarted after kill -9");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(wait_unit_ready(&podman, &name, &host), subnet, "a crash changed the subnet");
    let journal = podman.sh(&name, "journalctl -u weft --no-pager -o cat");
    assert!(journal.contains("taking the data plane from systemd's fd store"), "{journal}");
    ping_all_pairs(&pods, Families::V4);
    podman.sh(&name, "systemctl stop weft");
    assert_eq!(unit_property(&podman, &name, "Result"), "success");
    assert_eq!(unit_property(&podman, &name, "ExecMainStatus"), "0");
    podman.sh(&name, "test -s /run/flannel/subnet.env && test -s /var/lib/weft/node-id");
    podman.sh(&name, "systemctl start weft");
    assert_eq!(wait_unit_ready(&podman, &name, &host), subnet, "a restart changed the subnet");
}
