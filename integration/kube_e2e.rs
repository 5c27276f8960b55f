//! weft on the Kubernetes subnet manager (`--kube-subnet-mgr`), end to end: namespace hosts
//! whose Nodes live on a real kube-apiserver in the hub (support/kube.rs), weft reaching it
//! with the service account of `deploy/kube-weft.yml` (so with that manifest's RBAC and no
//! more), pods behind each host pinging each other over vxlan.
//!
//! `cargo test --features kube,netns --test kube_e2e` (root; after
//! `scripts/kube-apiserver.sh build`).

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use support::kube::KubeApi;
use support::netns::{Lab, Pod, Weft, ping_ok};

const NETWORK: &str = r#"{"Network":"10.244.0.0/16","Backend":{"Type":"vxlan"}}"#;
const READY: Duration = Duration::from_secs(30);

/// The files every kube-mode weft of a lab reads: the manifest's service-account kubeconfig
/// and kube-flannel's net-conf.json.
fn kube_files(lab: &Lab, kube: &KubeApi) -> (PathBuf, PathBuf) {
    let dir = lab.dir().join("kube-weft");
    std::fs::create_dir_all(&dir).expect("dir");
    let kubeconfig = dir.join("kubeconfig");
    kube.manifest_kubeconfig(&kubeconfig, 0);
    let net_conf = dir.join("net-conf.json");
    std::fs::write(&net_conf, NETWORK).expect("net-conf.json");
    (kubeconfig, net_conf)
}

/// Host `n`'s weft on the subnet manager, as Node `node-<n>`.
fn kube_weft(lab: &Lab, n: u8, files: &(PathBuf, PathBuf)) -> Weft {
    let (kubeconfig, net_conf) = (files.0.to_str().unwrap(), files.1.to_str().unwrap());
    let args =
        ["--kube-subnet-mgr", "--kubeconfig-file", kubeconfig, "--net-config-path", net_conf];
    let mut w = lab.unstarted_weft(n, &args);
    w.env.push(("NODE_NAME".into(), format!("node-{n}")));
    w.start();
    w
}

fn wait_until(what: &str, within: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !ok() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn two_nodes_lease_their_podcidrs_announce_them_and_ping_each_other() {
    let lab = Lab::new(NETWORK);
    let kube = KubeApi::in_lab(&lab);
    kube.create_node("node-1", &["10.244.1.0/24"]);
    kube.create_node("node-2", &["10.244.2.0/24"]);
    let files = kube_files(&lab, &kube);
    let mut wefts = [kube_weft(&lab, 1, &files), kube_weft(&lab, 2, &files)];
    for (w, want) in wefts.iter_mut().zip(["10.244.1.0/24", "10.244.2.0/24"]) {
        assert_eq!(w.wait_ready(READY), want, "the subnet is not the podCIDR:\n{}", w.log_tail(30));
    }
    for n in [1, 2] {
        let node = format!("node-{n}");
        let ann = |k: &str| kube.flannel_annotation(&node, k);
        assert_eq!(ann("kube-subnet-manager").as_deref(), Some("true"));
        assert_eq!(ann("backend-type").as_deref(), Some("vxlan"));
        assert_eq!(ann("public-ip"), Some(format!("192.0.2.{n}")));
        let data: serde_json::Value =
            serde_json::from_str(&ann("backend-data").expect("backend-data")).expect("JSON");
        assert_eq!(data["VNI"], 1, "{data}");
        wait_until(&format!("{node}'s NetworkUnavailable=False"), READY, || {
            kube.condition(&node, "NetworkUnavailable")
                .is_some_and(|c| c["status"] == "False" && c["reason"] == "FlannelIsUp")
        });
    }
    for w in &wefts {
        w.wait_metric("weft_routes", Duration::from_secs(10), |v| v >= 1.0);
    }
    let pods: Vec<Pod> = wefts.iter().map(|w| lab.pod(w.n, &w.subnet_file())).collect();
    ping_ok(&pods[0].ns, pods[1].ip, 3);
    ping_ok(&pods[1].ns, pods[0].ip, 3);
    for w in &mut wefts {
        assert!(w.running(), "{}", w.log_tail(20));
        assert!(!w.log().contains("ERROR"), "weft {} logged an error:\n{}", w.n, w.log_tail(40));
    }
}
