//! flannel's own Kubernetes subnet manager against the lab's control plane (support/kube.rs):
//! a real flanneld v0.19 in `--kube-subnet-mgr` mode in a namespace host, with the credentials
//! `deploy/kube-weft.yml` gives weft (its service account, bound to the manifest's ClusterRole
//! alone) and the manifest's own `net-conf.json`. It takes its subnet from its Node's podCIDR,
//! publishes its lease as the Node's annotations and sets `NetworkUnavailable=False`: what weft's
//! Kubernetes subnet manager must read and write the same way, and proof that the manifest's
//! RBAC is enough for flannel's own calls (the real authorizer refuses none of them).
//!
//! `FLANNELD=/path/to/flanneld cargo test --features flanneld --test kube_flanneld` (root;
//! flanneld from `../shared/tools/build-flanneld`).

mod support;

use support::kube::{KubeApi, KubeFlanneld};
use support::netns::Lab;

const NETWORK: &str = r#"{"Network":"10.244.0.0/16","Backend":{"Type":"vxlan"}}"#;

#[test]
fn flanneld_in_kube_mode_leases_its_podcidr_and_publishes_it_on_the_manifests_rbac() {
    let lab = Lab::new(NETWORK);
    let kube = KubeApi::in_lab(&lab);
    let kubeconfig = lab.dir().join("kube").join("weft.kubeconfig");
    kube.manifest_kubeconfig(&kubeconfig, 0);
    let cm = kube.admin("GET", "/api/v1/namespaces/kube-weft/configmaps/kube-weft-cfg", None);
    let net_conf = cm["data"]["net-conf.json"].as_str().expect("net-conf.json").to_owned();
    kube.create_node("node-1", &["10.244.7.0/24"]);

    let flanneld = KubeFlanneld::start(&lab, 1, "node-1", &kubeconfig, &net_conf);
    let env = flanneld.subnet_env();
    assert!(env.contains("FLANNEL_NETWORK=10.244.0.0/16"), "{env}");
    assert!(env.contains("FLANNEL_SUBNET=10.244.7.1/24"), "{env}");

    // The annotations and the condition come a moment after subnet.env.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let condition = loop {
        if let Some(c) = kube.condition("node-1", "NetworkUnavailable") {
            break c;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no NetworkUnavailable condition:\n{}",
            flanneld.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert_eq!(condition["status"], "False", "{condition}");
    assert_eq!(condition["reason"], "FlannelIsUp", "{condition}");
    let get = |key: &str| kube.flannel_annotation("node-1", key);
    assert_eq!(get("backend-type").as_deref(), Some("vxlan"));
    assert_eq!(get("public-ip").as_deref(), Some("192.0.2.1"));
    assert_eq!(get("kube-subnet-manager").as_deref(), Some("true"));
    let data: serde_json::Value = serde_json::from_str(&get("backend-data").expect("backend-data"))
        .expect("backend-data is JSON");
    assert!(data["VtepMAC"].as_str().is_some_and(|m| m.len() == 17), "{data}");
    let log = flanneld.log();
    assert!(
        !log.to_lowercase().contains("forbidden"),
        "a call the manifest's RBAC refused:\n{log}"
    );
}

/// Two weft nodes and a flanneld v0.19 node in one Kubernetes-managed network: each reads the
/// others' leases from their Nodes, and pods behind all three ping every way.
#[test]
fn two_weft_nodes_and_a_flanneld_node_share_one_network_and_ping_every_way() {
    let lab = Lab::new(NETWORK);
    let kube = KubeApi::in_lab(&lab);
    for (n, cidr) in [(1, "10.244.1.0/24"), (2, "10.244.2.0/24"), (3, "10.244.3.0/24")] {
        kube.create_node(&format!("node-{n}"), &[cidr]);
    }
    let files = support::kube::kube_files(&lab, &kube, NETWORK);
    let flanneld = KubeFlanneld::start(&lab, 3, "node-3", &files.0, NETWORK);
    let mut wefts =
        [support::kube::kube_weft(&lab, 1, &files), support::kube::kube_weft(&lab, 2, &files)];
    for w in &mut wefts {
        w.wait_ready(std::time::Duration::from_secs(30));
        w.wait_metric("weft_routes", std::time::Duration::from_secs(20), |v| v >= 2.0);
    }
    let mut pods: Vec<support::netns::Pod> =
        wefts.iter().map(|w| lab.pod(w.n, &w.subnet_file())).collect();
    pods.push(lab.pod(3, &flanneld.dir.join("subnet.env")));
    for a in &pods {
        for b in &pods {
            if a.ns != b.ns {
                support::netns::ping_ok(&a.ns, b.ip, 2);
            }
        }
    }
}
