//! weft on the Kubernetes subnet manager (`--kube-subnet-mgr`), end to end: namespace hosts
//! whose Nodes live on a real kube-apiserver in the hub (support/kube.rs), weft reaching it
//! with the service account of `deploy/kube-weft.yml` (so with that manifest's RBAC and no
//! more), pods behind each host pinging each other over vxlan.
//!
//! `cargo test --features kube,netns --test kube_e2e` (root; after
//! `scripts/kube-apiserver.sh build`).

mod support;

use std::time::{Duration, Instant};

use support::kube::{KubeApi, kube_files, kube_weft, kube_weft_with};
use support::netns::{Lab, Pod, Weft, ping_ok};

const NETWORK: &str = r#"{"Network":"10.244.0.0/16","Backend":{"Type":"vxlan"}}"#;
const READY: Duration = Duration::from_secs(30);

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
    let files = kube_files(&lab, &kube, NETWORK);
    // As kube-flannel's DaemonSet runs: with --ip-masq.
    let mut wefts = [
        kube_weft_with(&lab, 1, &files, &["--ip-masq"]),
        kube_weft_with(&lab, 2, &files, &["--ip-masq"]),
    ];
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
    for w in &wefts {
        let nft = lab.exec(&w.ns, &["nft", "list", "table", "ip", "weft"]);
        let rules = String::from_utf8_lossy(&nft.stdout);
        assert!(rules.contains("masquerade"), "no masquerade rules on host {}: {rules}", w.n);
    }
    for w in &mut wefts {
        assert!(w.running(), "{}", w.log_tail(20));
        assert!(!w.log().contains("ERROR"), "weft {} logged an error:\n{}", w.n, w.log_tail(40));
    }
}

/// Both hosts up on their podCIDRs, their pods pinging each other: the start of every story.
fn two_up(lab: &Lab, kube: &KubeApi) -> ([Weft; 2], Vec<Pod>) {
    kube.create_node("node-1", &["10.244.1.0/24"]);
    kube.create_node("node-2", &["10.244.2.0/24"]);
    let files = kube_files(lab, kube, NETWORK);
    let mut wefts = [kube_weft(lab, 1, &files), kube_weft(lab, 2, &files)];
    for w in &mut wefts {
        w.wait_ready(READY);
        w.wait_metric("weft_routes", Duration::from_secs(10), |v| v >= 1.0);
    }
    let pods: Vec<Pod> = wefts.iter().map(|w| lab.pod(w.n, &w.subnet_file())).collect();
    ping_ok(&pods[0].ns, pods[1].ip, 2);
    (wefts, pods)
}

/// The Node deleted under a running weft: a lost lease, loud and counted, not ready, forwarding
/// on. Re-created with another podCIDR (as the controller manager would give it): a subnet
/// change, `subnet.env` rewritten, the hook run, the other host routing to the new subnet and
/// no longer to the old one.
#[test]
fn a_deleted_node_is_a_lost_lease_and_its_new_podcidr_a_subnet_change() {
    let lab = Lab::new(NETWORK);
    let kube = KubeApi::in_lab(&lab);
    kube.create_node("node-1", &["10.244.1.0/24"]);
    kube.create_node("node-2", &["10.244.2.0/24"]);
    let files = kube_files(&lab, &kube, NETWORK);
    let hooks = lab.dir().join("hooks.log");
    let hook = format!("echo \"$0 $1 $2\" >> {}", hooks.display());
    let w1 = {
        let mut w = kube_weft(&lab, 1, &files);
        w.wait_ready(READY);
        w
    };
    let mut w2 = {
        kube_weft_with(&lab, 2, &files, &["--on-subnet-change", &hook, "--on-lease-lost", &hook])
    };
    assert_eq!(w2.wait_ready(READY), "10.244.2.0/24");
    w1.wait_metric("weft_routes", Duration::from_secs(10), |v| v >= 1.0);
    let pods: Vec<Pod> = [&w1, &w2].iter().map(|w| lab.pod(w.n, &w.subnet_file())).collect();
    ping_ok(&pods[0].ns, pods[1].ip, 2);

    kube.delete_node("node-2");
    w2.wait_log("LEASE LOST: the Node node-2 was deleted", READY);
    wait_until("host 2 unready without its Node", READY, || !w2.ready());
    let (code, body) = w2.get("/readyz");
    assert!(code == 503 && body.contains("node-2 does not exist"), "{code} {body}");
    assert_eq!(w2.metric("weft_lease_losses_total"), Some(1.0));

    kube.create_node("node-2", &["10.244.9.0/24"]);
    assert_eq!(w2.wait_ready(READY), "10.244.9.0/24", "{}", w2.log_tail(30));
    w2.wait_log("this node's podCIDR changed", READY);
    wait_until("the hooks ran", READY, || {
        let text = std::fs::read_to_string(&hooks).unwrap_or_default();
        text.contains("10.244.2.0/24") && text.lines().count() >= 2
    });
    let text = std::fs::read_to_string(&hooks).unwrap_or_default();
    assert!(text.contains("10.244.2.0/24 10.244.9.0/24"), "no subnet-change hook: {text}");
    assert_eq!(kube.flannel_annotation("node-2", "public-ip").as_deref(), Some("192.0.2.2"));
    // A pod on the new subnet (cni0 still has the old gateway address: the bridge plugin
    // refuses to add another, as on any flannel node whose subnet changed).
    let ns2 = lab.host(2);
    lab.exec(&ns2, &["ip", "link", "del", "cni0"]);
    let _ = std::process::Command::new("ip").args(["netns", "del", &pods[1].ns]).status();
    let moved = lab.pod(2, &w2.subnet_file());
    assert!(moved.ip.to_string().starts_with("10.244.9."), "{}", moved.ip);
    wait_until("host 1 routes to the new subnet", READY, || {
        support::netns::ping_lossy(&pods[0].ns, moved.ip, 1, 0.2).received == 1
    });
    ping_ok(&moved.ns, pods[0].ip, 2);
    let route_count = w1.metric("weft_routes");
    assert_eq!(route_count, Some(1.0), "host 1 still routes to the old subnet");
}

/// The API server gone for a while: pods keep pinging on the last routes, weft says why it is
/// not ready, and is ready again once the server is back.
#[test]
fn an_api_server_outage_keeps_traffic_and_says_why() {
    let lab = Lab::new(NETWORK);
    let mut kube = KubeApi::in_lab(&lab);
    let (mut wefts, pods) = two_up(&lab, &kube);
    let ping = support::netns::spawn_ping(&pods[0].ns, pods[1].ip, 100, 0.1);
    std::thread::sleep(Duration::from_secs(1));
    kube.kill_apiserver();
    wait_until("host 1 says the API server is gone", READY, || {
        let (code, body) = wefts[0].get("/readyz");
        code == 503 && body.contains("cannot read the Node node-1")
    });
    std::thread::sleep(Duration::from_secs(3));
    kube.start_apiserver();
    let r = support::netns::finish_ping(ping);
    assert!(r.loss() < 0.05, "pings lost across the outage: {}", r.text);
    for w in &mut wefts {
        wait_until("ready again after the outage", READY, || w.ready());
        assert!(w.running());
    }
    ping_ok(&pods[1].ns, pods[0].ip, 2);
}

/// A third Node announcing host 1's subnet is named, counted and never routed to; the
/// credentials' rights revoked (the binding deleted) make weft unready with the server's
/// refusal, forwarding on; the token never shows in the log.
#[test]
fn a_node_claiming_anothers_subnet_is_ignored_and_a_revoked_binding_is_told() {
    let lab = Lab::new(NETWORK);
    let kube = KubeApi::in_lab(&lab);
    let (wefts, pods) = two_up(&lab, &kube);
    let p = support::kube::ANNOTATION_PREFIX;
    kube.create_node_with(
        "node-3",
        &["10.244.1.0/24"],
        &[
            (&format!("{p}/kube-subnet-manager"), "true"),
            (&format!("{p}/backend-type"), "vxlan"),
            (&format!("{p}/backend-data"), r#"{"VNI":1,"VtepMAC":"8e:00:00:00:00:03"}"#),
            (&format!("{p}/public-ip"), "192.0.2.3"),
        ],
    );
    wefts[1].wait_log("the Node node-3 announces the subnet 10.244.1.0/24", READY);
    assert_eq!(wefts[1].metric("weft_kube_node_subnet_conflicts"), Some(1.0));
    ping_ok(&pods[1].ns, pods[0].ip, 3);

    let out = kube.kubectl(&["delete", "clusterrolebinding", "--all"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The next look at the Node (the watch is re-made, or the resync) is refused.
    kube.annotate_node("node-1", &[("example.com/poke", "1")]);
    wait_until("host 1 says its rights are gone", Duration::from_secs(60), || {
        let (code, body) = wefts[0].get("/readyz");
        code == 503
            && (body.contains("403") || body.contains("forbidden") || body.contains("credentials"))
    });
    ping_ok(&pods[0].ns, pods[1].ip, 3);
    let token = std::fs::read_to_string(lab.dir().join("kube-weft").join("kubeconfig")).unwrap();
    let token =
        token.lines().find_map(|l| l.trim().strip_prefix("token:")).unwrap().trim().to_owned();
    for w in &wefts {
        assert!(!w.log().contains(&token), "the token is in weft {}'s log", w.n);
    }
}

/// The other backends on the subnet manager: udp, host-gw and ipip nodes read each other's
/// Nodes and forward as on etcd.
#[test]
fn udp_host_gw_and_ipip_nodes_ping_each_other() {
    for backend in ["udp", "host-gw", "ipip"] {
        let network = format!(r#"{{"Network":"10.244.0.0/16","Backend":{{"Type":"{backend}"}}}}"#);
        let lab = Lab::new(&network);
        let kube = KubeApi::in_lab(&lab);
        kube.create_node("node-1", &["10.244.1.0/24"]);
        kube.create_node("node-2", &["10.244.2.0/24"]);
        let files = kube_files(&lab, &kube, &network);
        // host-gw's hosts forward (as any flannel node; weft does not set it), and with
        // --ip-masq the pods' bridge masquerades nothing: pods' packets cross the underlay
        // with their own addresses, as host-gw is run.
        for n in [1, 2] {
            support::process::lib_run("flannel.sh", "flannel_forwarding", &[&lab.host(n)]);
        }
        let masq = ["--ip-masq"];
        let mut wefts =
            [kube_weft_with(&lab, 1, &files, &masq), kube_weft_with(&lab, 2, &files, &masq)];
        for w in &mut wefts {
            w.wait_ready(READY);
            w.wait_metric("weft_routes", Duration::from_secs(10), |v| v >= 1.0);
        }
        assert_eq!(kube.flannel_annotation("node-1", "backend-type").as_deref(), Some(backend));
        let pods: Vec<Pod> = wefts.iter().map(|w| lab.pod(w.n, &w.subnet_file())).collect();
        for (a, b) in [(&pods[0], &pods[1]), (&pods[1], &pods[0])] {
            let r = support::netns::ping_lossy(&a.ns, b.ip, 2, 0.2);
            assert_eq!(r.received, 2, "{backend}: {} -> {}:\n{}", a.ns, b.ip, r.text);
        }
    }
}
