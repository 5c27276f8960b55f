//! A real Kubernetes control plane for tests: kube-apiserver v1.20.2 (built once per machine by
//! `scripts/kube-apiserver.sh build`) with an etcd of its own, started with
//! `scripts/lib/kube-apiserver.sh`'s functions, the one home of its command line.
//!
//! Two places it runs:
//! - [`KubeApi::in_lab`]: inside a [`Lab`]'s hub namespace, serving
//!   `https://192.0.2.254:6443`, so weft (and flanneld) in the lab's host namespaces reach it as
//!   nodes reach a control plane. Its etcd listens on the hub's loopback (127.0.0.1:2479), not on
//!   the underlay: the lab's etcd (192.0.2.254:2379) stays the etcd suites' own, and a test that
//!   pauses or restarts either one leaves the other alone.
//! - [`KubeApi::on_loopback`]: in the root namespace on 127.0.0.1, free ports, no root needed
//!   (the manifest's tests).
//!
//! No controller manager, scheduler or kubelet: a Node is a plain API object, and a test sets
//! its `spec.podCIDR(s)` as the controller manager's node IPAM would ([`KubeApi::create_node`]).
//! RBAC is on and anonymous requests are refused. Two static users: `admin` (group
//! `system:masters`; every helper here acts as it) and [`TEST_USER`], with no rights until a
//! test binds a role to it ([`KubeApi::bind_cluster_role`]).
//!
//! Contract:
//! - Needs the cached kube-apiserver ([`apiserver_binary`]), etcd, curl and openssl; a missing
//!   one is a loud panic naming the command that provides it, never a skipped test.
//! - Requests go through `curl` with the token in a header file (`-H @FILE`): tokens are never
//!   on a command line, in a log or in a file other users can read (the secrets dir is 0700,
//!   its files 0600; kubeconfigs are 0600).
//! - Dropping a [`KubeApi`] SIGKILLs and reaps the API server and its etcd (each also dies with
//!   the test's thread, `PR_SET_PDEATHSIG`); when the test is panicking, it prints the tail of
//!   the API server's log, and the dir (its logs) is kept: in a lab, the lab keeps its dir;
//!   on loopback, its own temp dir is kept and its path printed.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs::File;
use std::io::Write;
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::netns::{Lab, Weft};
use super::process::{Daemon, lib_command, lib_run};

/// The unprivileged user of every control plane (the static token file's second line).
pub const TEST_USER: &str = "weft-test";

/// flanneld's default annotation prefix (`--kube-annotation-prefix`).
pub const ANNOTATION_PREFIX: &str = "flannel.alpha.coreos.com";

/// weft's Kubernetes manifest.
pub const MANIFEST: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/kube-weft.yml");
/// The namespace and service account the manifest runs weft as.
pub const MANIFEST_NAMESPACE: &str = "kube-weft";
/// See [`MANIFEST_NAMESPACE`].
pub const MANIFEST_SERVICE_ACCOUNT: &str = "weft";

/// The annotations a kubelet puts on the Node it registers (v1.20). Every real Node has some:
/// flanneld v0.19 assumes so and panics on a Node without any ("assignment to entry in nil
/// map", kube.go AcquireLease), so [`KubeApi::create_node`] adds these.
pub const KUBELET_ANNOTATIONS: &[(&str, &str)] = &[
    ("node.alpha.kubernetes.io/ttl", "0"),
    ("volumes.kubernetes.io/controller-managed-attach-detach", "true"),
];

/// The API server's address and port inside a lab's hub.
pub const LAB_APISERVER: (Ipv4Addr, u16) = (Ipv4Addr::new(192, 0, 2, 254), 6443);

/// How long the API server may take to answer `/readyz` (about 7 s on an idle machine).
const READY_DEADLINE: Duration = Duration::from_secs(90);

/// `KUBE_APISERVER_BIN`, else the shell library's cached path; panics when it is not built.
pub fn apiserver_binary() -> PathBuf {
    let path = std::env::var_os("KUBE_APISERVER_BIN").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(lib_run::<&str>("kube-apiserver.sh", "kube_apiserver_path", &[]).trim())
    });
    assert!(
        path.is_file(),
        "no kube-apiserver at {}: run scripts/kube-apiserver.sh build (scripts/test.sh does)",
        path.display()
    );
    path
}

/// Who a request is made as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum As {
    /// `admin`, group `system:masters`.
    Admin,
    /// [`TEST_USER`]: only what a test bound to it.
    User,
}

impl As {
    fn file(self) -> &'static str {
        match self {
            As::Admin => "admin",
            As::User => "user",
        }
    }
}

/// An answer from the API server: the HTTP status and the body (JSON when the server sent
/// JSON; [`Value::String`] otherwise, e.g. `/readyz`'s `ok`).
#[derive(Debug, Clone)]
pub struct Reply {
    /// The HTTP status; 0 when nothing answered (connection refused, timeout).
    pub status: u16,
    /// The body.
    pub body: Value,
}

impl Reply {
    /// A 2xx status.
    pub fn ok(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// One control plane. See the module docs.
pub struct KubeApi {
    /// Where its logs, kubeconfigs and secrets (`secrets/`, 0700) are.
    dir: PathBuf,
    /// The temp dir a loopback control plane owns (a lab's lives in the lab's dir).
    own_dir: Option<tempfile::TempDir>,
    /// The hub namespace, for a lab's.
    ns: Option<String>,
    addr: Ipv4Addr,
    port: u16,
    etcd_port: u16,
    etcd_peer_port: u16,
    etcd: Daemon,
    apiserver: Daemon,
}

fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind a free port");
    listener.local_addr().expect("local address").port()
}

impl KubeApi {
    /// A control plane inside `lab`'s hub, serving `https://192.0.2.254:6443`; ready (`/readyz`
    /// ok) when it returns. Its files are in `<lab dir>/kube`.
    pub fn in_lab(lab: &Lab) -> Self {
        let dir = lab.dir().join("kube");
        std::fs::create_dir_all(&dir).expect("kube dir");
        let (addr, port) = LAB_APISERVER;
        Self::start(dir, None, Some(lab.hub()), addr, (port, 2479, 2480))
    }

    /// A control plane on the root namespace's 127.0.0.1, on free ports, in a temp dir of its
    /// own; ready when it returns. Needs no root.
    pub fn on_loopback() -> Self {
        let own = tempfile::Builder::new().prefix("weft-kube-").tempdir().expect("tempdir");
        let dir = own.path().to_owned();
        Self::start(
            dir,
            Some(own),
            None,
            Ipv4Addr::LOCALHOST,
            (free_port(), free_port(), free_port()),
        )
    }

    fn start(
        dir: PathBuf,
        own_dir: Option<tempfile::TempDir>,
        ns: Option<String>,
        addr: Ipv4Addr,
        (port, etcd_port, etcd_peer_port): (u16, u16, u16),
    ) -> Self {
        for tool in ["curl", "openssl", "etcd"] {
            assert!(
                Command::new("sh")
                    .args(["-c", &format!("command -v {tool}")])
                    .stdout(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success()),
                "{tool} not found: run scripts/setup.sh"
            );
        }
        apiserver_binary();
        let mut kube = Self {
            dir,
            own_dir,
            ns,
            addr,
            port,
            etcd_port,
            etcd_peer_port,
            etcd: Daemon::default(),
            apiserver: Daemon::default(),
        };
        // From here on a panic drops `kube`, which stops whatever started.
        let secrets = kube.secrets();
        lib_run("kube-apiserver.sh", "kube_control_plane_files", &[&secrets]);
        kube.start_etcd();
        kube.start_apiserver();
        for (user, token, file) in [
            ("admin", "admin.token", "admin.kubeconfig"),
            (TEST_USER, "user.token", "user.kubeconfig"),
        ] {
            kube.write_kubeconfig(user, &secrets.join(token), &kube.dir.join(file));
        }
        kube
    }

    /// The secrets dir (0700): tokens, the service-account key, the serving certificate.
    fn secrets(&self) -> PathBuf {
        self.dir.join("secrets")
    }

    /// `FUNCTION ARGS...` from kube-apiserver.sh with this control plane's ports.
    fn lib(&self, function: &str, args: &[OsString]) -> Command {
        let mut cmd = lib_command("kube-apiserver.sh", function, args);
        cmd.env("KUBE_APISERVER_PORT", self.port.to_string())
            .env("KUBE_ETCD_PORT", self.etcd_port.to_string())
            .env("KUBE_ETCD_PEER_PORT", self.etcd_peer_port.to_string())
            .env("KUBE_APISERVER_BIN", apiserver_binary())
            .env("ETCD_BIN", super::etcd::etcd_binary());
        cmd
    }

    fn log(&self, name: &str) -> File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(name))
            .expect("open a control-plane log")
    }

    fn start_etcd(&mut self) {
        let mut args = vec![self.dir.clone().into_os_string()];
        args.extend(self.ns.clone().map(OsString::from));
        let log = self.log("etcd.log");
        let mut cmd = self.lib("kube_etcd", &args);
        cmd.stdin(Stdio::null()).stdout(log.try_clone().expect("log fd")).stderr(log);
        self.etcd.start(&mut cmd);
    }

    /// Starts the API server (again, after [`KubeApi::stop_apiserver`]: same etcd, same
    /// certificate and tokens, so every client's kubeconfig still works) and waits until
    /// `/readyz` is ok.
    ///
    /// # Panics
    /// If it exits or is not ready within 90 s: with its log's tail.
    pub fn start_apiserver(&mut self) {
        let mut args = vec![self.secrets().into_os_string(), self.addr.to_string().into()];
        args.extend(self.ns.clone().map(OsString::from));
        let log = self.log("apiserver.log");
        let mut cmd = self.lib("kube_apiserver", &args);
        cmd.stdin(Stdio::null()).stdout(log.try_clone().expect("log fd")).stderr(log);
        self.apiserver.start(&mut cmd);
        let deadline = Instant::now() + READY_DEADLINE;
        loop {
            let reply = self.request(As::Admin, "GET", "/readyz", None);
            if reply.status == 200 {
                return;
            }
            let dead = !self.apiserver.running() || !self.etcd.running();
            assert!(
                !dead && Instant::now() < deadline,
                "kube-apiserver {} (last answer {reply:?}):\n{}",
                if dead { "exited" } else { "not ready in time" },
                self.log_tail(30)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Stops the API server (SIGTERM, then waits): an API outage; its etcd keeps running.
    pub fn stop_apiserver(&mut self) {
        let tail = self.log_tail(20);
        self.apiserver.stop(|| tail);
    }

    /// Kills the API server (SIGKILL): gone at once, as a crashed or unplugged one.
    pub fn kill_apiserver(&mut self) {
        self.apiserver.kill();
    }

    /// SIGSTOPs the API server (`true`) or SIGCONTs it: its socket stays open and nothing
    /// answers.
    pub fn pause_apiserver(&self, pause: bool) {
        if pause { self.apiserver.suspend() } else { self.apiserver.resume() }
    }

    /// The last `n` lines of the API server's log.
    pub fn log_tail(&self, n: usize) -> String {
        let log = std::fs::read_to_string(self.dir.join("apiserver.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// The server's URL: `https://192.0.2.254:6443` in a lab.
    pub fn url(&self) -> String {
        format!("https://{}:{}", self.addr, self.port)
    }

    /// The dir with the logs and kubeconfigs.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The admin's kubeconfig (0600; the server's certificate embedded).
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.dir.join("admin.kubeconfig")
    }

    /// [`TEST_USER`]'s kubeconfig (0600).
    pub fn user_kubeconfig(&self) -> PathBuf {
        self.dir.join("user.kubeconfig")
    }

    /// Writes a kubeconfig for `user` with the token in `token_file` at `out` (0600, owned by
    /// the test's user: chown it for a weft that runs as another).
    pub fn write_kubeconfig(&self, user: &str, token_file: &Path, out: &Path) {
        let args: Vec<OsString> = vec![
            self.secrets().into(),
            self.addr.to_string().into(),
            user.into(),
            token_file.into(),
            out.into(),
        ];
        let mut cmd = self.lib("kube_kubeconfig", &args);
        super::process::run_command(&mut cmd);
    }

    /// Writes a kubeconfig at `out` (0600) for service account `namespace/name`, with a token
    /// from the TokenRequest API (valid an hour), as a pod's in-cluster credentials would be.
    pub fn write_service_account_kubeconfig(&self, namespace: &str, name: &str, out: &Path) {
        let token = self.service_account_token(namespace, name);
        let token_file = self.secrets().join(format!("sa-{namespace}-{name}.token"));
        write_secret(&token_file, &token);
        self.write_kubeconfig(
            &format!("system:serviceaccount:{namespace}:{name}"),
            &token_file,
            out,
        );
    }

    /// Applies `deploy/kube-weft.yml` for real (its Namespace, ServiceAccount, ClusterRole and
    /// binding, ConfigMap and DaemonSet; no controller runs the DaemonSet here).
    pub fn apply_manifest(&self) {
        let out = self.kubectl(&["apply", "-f", MANIFEST]);
        assert!(
            out.status.success(),
            "kubectl apply -f {MANIFEST}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The credentials the manifest gives weft: applies it ([`KubeApi::apply_manifest`]) and
    /// writes at `out` a kubeconfig of its service account (`kube-weft/weft`, bound to the
    /// manifest's ClusterRole and nothing else), mode 0600 and owned by `uid` (65534 for a
    /// non-root weft). What a weft pod's in-cluster credentials allow, for a weft in a lab host.
    pub fn manifest_kubeconfig(&self, out: &Path, uid: u32) {
        self.apply_manifest();
        self.write_service_account_kubeconfig(MANIFEST_NAMESPACE, MANIFEST_SERVICE_ACCOUNT, out);
        std::os::unix::fs::chown(out, Some(uid), Some(uid)).expect("chown the kubeconfig");
    }

    /// `cmd` run in the hub namespace for a lab's control plane, else as is.
    fn in_ns(&self, program: &str) -> Command {
        match &self.ns {
            Some(ns) => {
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec", ns, program]);
                cmd
            }
            None => Command::new(program),
        }
    }

    /// `METHOD PATH` with an optional `(content type, body)`, as `who`. Never panics on an
    /// HTTP error: the caller asserts on the [`Reply`].
    pub fn request(&self, who: As, method: &str, path: &str, body: Option<(&str, &str)>) -> Reply {
        let secrets = self.secrets();
        let mut cmd = self.in_ns("curl");
        cmd.args(["-sS", "--max-time", "10", "-o", "-", "-w", "\n%{http_code}", "-X", method])
            .arg("--cacert")
            .arg(secrets.join("certs/apiserver.crt"))
            .arg("-H")
            .arg(format!("@{}", secrets.join(format!("{}.header", who.file())).display()));
        if let Some((content_type, _)) = body {
            cmd.args(["-H", &format!("Content-Type: {content_type}"), "--data-binary", "@-"]);
        }
        cmd.arg(format!("{}{path}", self.url()))
            .stdin(if body.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child =
            super::process::die_with_parent(&mut cmd).spawn().expect("curl: run scripts/setup.sh");
        if let Some((_, data)) = body {
            child.stdin.take().expect("stdin").write_all(data.as_bytes()).expect("request body");
        }
        let out = child.wait_with_output().expect("curl");
        let text = String::from_utf8_lossy(&out.stdout);
        let (text, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        let status = code.trim().parse().unwrap_or(0);
        let body = serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()));
        Reply { status, body }
    }

    /// `METHOD PATH` with a JSON body (or none) as the admin; must succeed; the reply's body.
    ///
    /// # Panics
    /// On a non-2xx answer, with the server's message.
    pub fn admin(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let content_type = match method {
            "PATCH" => "application/merge-patch+json",
            _ => "application/json",
        };
        let body = body.map(|b| b.to_string());
        let reply =
            self.request(As::Admin, method, path, body.as_deref().map(|b| (content_type, b)));
        assert!(reply.ok(), "{method} {path}: {} {}", reply.status, reply.body);
        reply.body
    }

    /// `kubectl ARGS` as the admin (`KUBECONFIG`), from the hub for a lab's; its output, not
    /// asserted. `KUBECTL` names another kubectl.
    pub fn kubectl(&self, args: &[&str]) -> std::process::Output {
        let kubectl = std::env::var("KUBECTL").unwrap_or_else(|_| "kubectl".into());
        let mut cmd = self.in_ns(&kubectl);
        cmd.args(args)
            .env("KUBECONFIG", self.admin_kubeconfig())
            .env("HOME", &self.dir)
            .stdin(Stdio::null());
        super::process::die_with_parent(&mut cmd)
            .output()
            .unwrap_or_else(|e| panic!("{kubectl} not runnable ({e}): run scripts/setup.sh"))
    }

    /// Creates Node `name` as a kubelet registers one and the controller manager's node IPAM
    /// completes it: the kubelet's two annotations ([`KUBELET_ANNOTATIONS`]) and
    /// `spec.podCIDRs` = `pod_cidrs` (`spec.podCIDR` the first; neither when empty).
    pub fn create_node(&self, name: &str, pod_cidrs: &[&str]) -> Value {
        self.create_node_with(name, pod_cidrs, KUBELET_ANNOTATIONS)
    }

    /// [`KubeApi::create_node`] with `annotations` instead of the kubelet's (none at all: a
    /// Node no kubelet registered, whose `metadata.annotations` is absent).
    pub fn create_node_with(
        &self,
        name: &str,
        pod_cidrs: &[&str],
        annotations: &[(&str, &str)],
    ) -> Value {
        let mut node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}});
        if !annotations.is_empty() {
            let map: serde_json::Map<String, Value> =
                annotations.iter().map(|(k, v)| ((*k).to_owned(), json!(v))).collect();
            node["metadata"]["annotations"] = Value::Object(map);
        }
        if let Some(first) = pod_cidrs.first() {
            node["spec"] = json!({"podCIDR": first, "podCIDRs": pod_cidrs});
        }
        self.admin("POST", "/api/v1/nodes", Some(node))
    }

    /// Sets a Node's podCIDRs where it has none (the server refuses to change them once set:
    /// delete and re-create the Node for that, [`KubeApi::recreate_node`]).
    pub fn set_pod_cidrs(&self, name: &str, pod_cidrs: &[&str]) -> Reply {
        let patch = json!({"spec": {"podCIDR": pod_cidrs.first(), "podCIDRs": pod_cidrs}});
        self.request(
            As::Admin,
            "PATCH",
            &format!("/api/v1/nodes/{name}"),
            Some(("application/merge-patch+json", &patch.to_string())),
        )
    }

    /// Deletes Node `name` and creates it again with `pod_cidrs`: a node whose podCIDR changed.
    pub fn recreate_node(&self, name: &str, pod_cidrs: &[&str]) -> Value {
        self.delete_node(name);
        self.create_node(name, pod_cidrs)
    }

    /// Deletes Node `name` (already gone is fine).
    pub fn delete_node(&self, name: &str) {
        let reply = self.request(As::Admin, "DELETE", &format!("/api/v1/nodes/{name}"), None);
        assert!(reply.ok() || reply.status == 404, "delete node {name}: {reply:?}");
    }

    /// Node `name`, if it exists.
    pub fn node(&self, name: &str) -> Option<Value> {
        let reply = self.request(As::Admin, "GET", &format!("/api/v1/nodes/{name}"), None);
        match reply.status {
            404 => None,
            _ if reply.ok() => Some(reply.body),
            _ => panic!("get node {name}: {reply:?}"),
        }
    }

    /// Node `name`'s annotations (empty when it has none); panics if it does not exist.
    pub fn annotations(&self, name: &str) -> BTreeMap<String, String> {
        let node = self.node(name).unwrap_or_else(|| panic!("no node {name}"));
        node["metadata"]["annotations"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Node `name`'s annotation `<ANNOTATION_PREFIX>/<key>`.
    pub fn flannel_annotation(&self, name: &str, key: &str) -> Option<String> {
        self.annotations(name).remove(&format!("{ANNOTATION_PREFIX}/{key}"))
    }

    /// Node `name`'s status condition of type `kind` (e.g. `NetworkUnavailable`), if set.
    pub fn condition(&self, name: &str, kind: &str) -> Option<Value> {
        let node = self.node(name).unwrap_or_else(|| panic!("no node {name}"));
        node["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == kind).cloned())
    }

    /// Sets annotations on Node `name` through `nodes/status` with a strategic-merge patch, as
    /// a flannel node publishes its own (another node's lease, written by hand).
    pub fn annotate_node(&self, name: &str, annotations: &[(&str, &str)]) {
        let map: serde_json::Map<String, Value> =
            annotations.iter().map(|(k, v)| ((*k).to_owned(), json!(v))).collect();
        let patch = json!({"metadata": {"annotations": map}}).to_string();
        let reply = self.request(
            As::Admin,
            "PATCH",
            &format!("/api/v1/nodes/{name}/status"),
            Some(("application/strategic-merge-patch+json", &patch)),
        );
        assert!(reply.ok(), "annotate node {name}: {reply:?}");
    }

    /// Creates namespace `name` (existing is fine).
    pub fn create_namespace(&self, name: &str) {
        let ns = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}});
        let reply = self.request(
            As::Admin,
            "POST",
            "/api/v1/namespaces",
            Some(("application/json", &ns.to_string())),
        );
        assert!(reply.ok() || reply.status == 409, "create namespace {name}: {reply:?}");
    }

    /// Creates service account `namespace/name` (and its namespace; existing is fine).
    pub fn create_service_account(&self, namespace: &str, name: &str) {
        self.create_namespace(namespace);
        let sa = json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}});
        let reply = self.request(
            As::Admin,
            "POST",
            &format!("/api/v1/namespaces/{namespace}/serviceaccounts"),
            Some(("application/json", &sa.to_string())),
        );
        assert!(reply.ok() || reply.status == 409, "create service account: {reply:?}");
    }

    /// A token for service account `namespace/name` (TokenRequest, an hour). Keep it out of
    /// logs and messages.
    pub fn service_account_token(&self, namespace: &str, name: &str) -> String {
        let request = json!({
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600}
        });
        let reply = self.request(
            As::Admin,
            "POST",
            &format!("/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token"),
            Some(("application/json", &request.to_string())),
        );
        // The body holds the token: say only the status.
        assert!(reply.ok(), "token request for {namespace}/{name}: status {}", reply.status);
        reply.body["status"]["token"].as_str().expect("token in the TokenRequest").to_owned()
    }

    /// Creates ClusterRole `name` with `rules` (RBAC's JSON form).
    pub fn create_cluster_role(&self, name: &str, rules: Value) {
        let role = json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": name}, "rules": rules
        });
        self.admin("POST", "/apis/rbac.authorization.k8s.io/v1/clusterroles", Some(role));
    }

    /// Binds ClusterRole `role` to `subject`: [`TEST_USER`] (or any user name), or a service
    /// account as `system:serviceaccount:NS:NAME`.
    pub fn bind_cluster_role(&self, role: &str, subject: &str) {
        let subject = match subject
            .strip_prefix("system:serviceaccount:")
            .and_then(|s| s.split_once(':'))
        {
            Some((ns, name)) => json!({"kind": "ServiceAccount", "name": name, "namespace": ns}),
            None => {
                json!({"kind": "User", "name": subject, "apiGroup": "rbac.authorization.k8s.io"})
            }
        };
        let name = format!("{role}-{:08x}", rand::random::<u32>());
        let binding = json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [subject]
        });
        self.admin("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", Some(binding));
    }

    /// Whether the real authorizer lets `user` (a user name, or
    /// `system:serviceaccount:NS:NAME`) do `verb` on `resource` (`nodes`, `nodes/status`) of
    /// the core API group: a SubjectAccessReview.
    pub fn can(&self, user: &str, verb: &str, resource: &str) -> bool {
        let (resource, subresource) = resource.split_once('/').unwrap_or((resource, ""));
        let mut groups = vec!["system:authenticated"];
        if user.starts_with("system:serviceaccount:") {
            groups.push("system:serviceaccounts");
        }
        let review = json!({
            "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {
                "user": user, "groups": groups,
                "resourceAttributes": {"group": "", "verb": verb, "resource": resource, "subresource": subresource}
            }
        });
        let reply =
            self.admin("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", Some(review));
        reply["status"]["allowed"].as_bool().unwrap_or(false)
    }
}

/// Writes `text` to a new file at `path`, mode 0600 from the start.
fn write_secret(path: &Path, text: &str) {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .expect("write a secret file");
    f.write_all(text.as_bytes()).expect("write a secret file");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod 0600");
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        let panicking = std::thread::panicking();
        if panicking {
            eprintln!(
                "--- kube-apiserver log ({}), last lines ---\n{}",
                self.dir.display(),
                self.log_tail(30)
            );
        }
        self.apiserver.kill();
        self.etcd.kill();
        if panicking && let Some(dir) = self.own_dir.take() {
            eprintln!("kube control plane: logs kept in {}", dir.keep().display());
        }
    }
}

/// A real flanneld (v0.19, `FLANNELD`: `../shared/tools/build-flanneld`) in `--kube-subnet-mgr`
/// mode in a lab host (`flannel_flanneld_kube_up`, scripts/lib/flannel.sh), as kube-flannel's
/// DaemonSet runs it: its subnet from its Node's podCIDR, its lease published as the Node's
/// annotations. Dropping it stops it (SIGTERM; what it programmed stays, as flanneld leaves it).
pub struct KubeFlanneld {
    /// Its dir: `subnet.env`, `log`, `pid`, `net-conf.json`.
    pub dir: PathBuf,
}

/// `FLANNELD`, a flanneld v0.19 binary; panics when it is unset or not executable.
pub fn flanneld_binary() -> PathBuf {
    let path = std::env::var_os("FLANNELD").map(PathBuf::from).unwrap_or_default();
    assert!(
        path.is_file(),
        "FLANNELD={} is not a flanneld binary: build one with ../shared/tools/build-flanneld",
        path.display()
    );
    path
}

impl KubeFlanneld {
    /// Starts flanneld in `lab`'s host `n` as Node `node`, with `kubeconfig`'s credentials and
    /// `net_conf` as its network config, and waits (20 s) for its subnet.env.
    ///
    /// # Panics
    /// If it writes no subnet.env: with its log's tail.
    pub fn start(lab: &Lab, n: u8, node: &str, kubeconfig: &Path, net_conf: &str) -> Self {
        let host = lab.host(n);
        let dir = lab.dir().join(format!("flanneld-{n}"));
        std::fs::create_dir_all(&dir).expect("flanneld dir");
        std::fs::write(dir.join("net-conf.json"), net_conf).expect("net-conf.json");
        let bin = flanneld_binary();
        let n = n.to_string();
        let args: [&std::ffi::OsStr; 6] = [
            bin.as_os_str(),
            host.as_ref(),
            n.as_ref(),
            dir.as_os_str(),
            kubeconfig.as_os_str(),
            node.as_ref(),
        ];
        lib_run("flannel.sh", "flannel_flanneld_kube_up", &args);
        let flanneld = Self { dir };
        lib_run("flannel.sh", "flannel_flanneld_wait", &[&flanneld.dir]);
        flanneld
    }

    /// Its subnet.env.
    pub fn subnet_env(&self) -> String {
        std::fs::read_to_string(self.dir.join("subnet.env")).unwrap_or_default()
    }

    /// What it logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }
}

impl Drop for KubeFlanneld {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "--- flanneld log ({}), last lines ---\n{}",
                self.dir.display(),
                lines[lines.len().saturating_sub(20)..].join("\n")
            );
        }
        let _ = lib_command("flannel.sh", "flannel_flanneld_down", &[&self.dir])
            .stdin(Stdio::null())
            .output();
    }
}

/// The files every kube-mode weft of a lab reads: the manifest's service-account kubeconfig
/// (so weft has that manifest's RBAC and no more) and kube-flannel's `net-conf.json`.
pub fn kube_files(lab: &Lab, kube: &KubeApi, network: &str) -> (PathBuf, PathBuf) {
    let dir = lab.dir().join("kube-weft");
    std::fs::create_dir_all(&dir).expect("dir");
    let kubeconfig = dir.join("kubeconfig");
    kube.manifest_kubeconfig(&kubeconfig, 0);
    let net_conf = dir.join("net-conf.json");
    std::fs::write(&net_conf, network).expect("net-conf.json");
    (kubeconfig, net_conf)
}

/// Host `n`'s `weft run --kube-subnet-mgr` with `files`, as Node `node-<n>`, started.
pub fn kube_weft(lab: &Lab, n: u8, files: &(PathBuf, PathBuf)) -> Weft {
    kube_weft_with(lab, n, files, &[])
}

/// [`kube_weft`] with more flags.
pub fn kube_weft_with(lab: &Lab, n: u8, files: &(PathBuf, PathBuf), extra: &[&str]) -> Weft {
    let (kubeconfig, net_conf) =
        (files.0.to_str().expect("utf-8"), files.1.to_str().expect("utf-8"));
    let mut args =
        vec!["--kube-subnet-mgr", "--kubeconfig-file", kubeconfig, "--net-config-path", net_conf];
    args.extend_from_slice(extra);
    let mut w = lab.unstarted_weft(n, &args);
    w.env.push(("NODE_NAME".into(), format!("node-{n}")));
    w.start();
    w
}
