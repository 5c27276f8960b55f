//! The lab's Kubernetes control plane (support/kube.rs): a real kube-apiserver in the hub
//! namespace at 192.0.2.254:6443, reached from a namespace host as a node reaches its control
//! plane, with RBAC, an outage and a restart. What the Kubernetes subnet manager's end-to-end
//! tests stand on.
//!
//! `cargo test --features kube,netns --test kube_lab` (root; after
//! `scripts/kube-apiserver.sh build`).

mod support;

use support::kube::{As, KubeApi, TEST_USER};
use support::netns::Lab;

const NETWORK: &str = r#"{"Network":"10.244.0.0/16","Backend":{"Type":"vxlan"}}"#;

/// `curl` from namespace `ns` to the API server with `kubeconfig`'s credentials: the HTTP
/// status of `GET path` (0: nothing answered).
fn get_from(lab: &Lab, ns: &str, kubeconfig: &std::path::Path, path: &str) -> u16 {
    // The kubeconfig holds what a client has: the server, its certificate, the token. kubectl
    // reads it from the host namespace, as weft will.
    let kubectl = std::env::var("KUBECTL").unwrap_or_else(|_| "kubectl".into());
    let out = lab.exec(
        ns,
        &[
            &kubectl,
            "--kubeconfig",
            kubeconfig.to_str().expect("utf-8 path"),
            "get",
            "--raw",
            path,
            "--request-timeout=5s",
            // Not root's ~/.kube: nothing of a test's outlives the lab.
            &format!("--cache-dir={}", lab.dir().join("kube").join("cache").display()),
        ],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        200
    } else if stderr.contains("Forbidden") || stderr.contains("forbidden") {
        403
    } else {
        0
    }
}

#[test]
fn the_hub_serves_the_api_to_lab_hosts_with_rbac_and_survives_a_restart() {
    let lab = Lab::new(NETWORK);
    let mut kube = KubeApi::in_lab(&lab);
    assert_eq!(kube.url(), "https://192.0.2.254:6443");
    let host = lab.host(1);

    // A Node as the controller manager leaves it: podCIDRs, no annotations yet.
    kube.create_node("node-1", &["10.244.1.0/24"]);
    kube.create_node("node-2", &[]);
    assert_eq!(kube.set_pod_cidrs("node-2", &["10.244.2.0/24"]).status, 200);
    let changed = kube.set_pod_cidrs("node-2", &["10.244.9.0/24"]);
    assert_eq!(changed.status, 422, "podCIDR is immutable once set: {changed:?}");
    let node = kube.recreate_node("node-2", &["10.244.9.0/24"]);
    assert_eq!(node["spec"]["podCIDRs"], serde_json::json!(["10.244.9.0/24"]));

    // Annotations and the condition, as a flannel node writes them through nodes/status.
    kube.annotate_node("node-1", &[("flannel.alpha.coreos.com/backend-type", "vxlan")]);
    assert_eq!(kube.flannel_annotation("node-1", "backend-type").as_deref(), Some("vxlan"));
    assert!(kube.condition("node-1", "NetworkUnavailable").is_none());

    // From the host: the unprivileged user is refused until a role is bound to it.
    let user = kube.user_kubeconfig();
    assert_eq!(get_from(&lab, &host, &user, "/api/v1/nodes"), 403);
    kube.create_cluster_role(
        "node-reader",
        serde_json::json!([{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]),
    );
    kube.bind_cluster_role("node-reader", TEST_USER);
    assert!(kube.can(TEST_USER, "list", "nodes"));
    assert!(!kube.can(TEST_USER, "patch", "nodes/status"));
    assert_eq!(get_from(&lab, &host, &user, "/api/v1/nodes"), 200);
    assert_eq!(kube.request(As::User, "GET", "/api/v1/nodes/node-1", None).status, 200);
    assert_eq!(kube.request(As::User, "DELETE", "/api/v1/nodes/node-1", None).status, 403);

    // The manifest's service account, from the host, with a token as a pod gets one: it reads
    // nodes; the node's spec is not its to change.
    let sa = lab.dir().join("kube").join("weft.kubeconfig");
    kube.manifest_kubeconfig(&sa, 65534);
    assert_eq!(get_from(&lab, &host, &sa, "/api/v1/nodes"), 200);
    assert!(kube.can("system:serviceaccount:kube-weft:weft", "patch", "nodes/status"));
    assert!(!kube.can("system:serviceaccount:kube-weft:weft", "patch", "nodes"));

    // An outage: nothing answers; after the restart everything is as it was.
    kube.stop_apiserver();
    assert_eq!(kube.request(As::Admin, "GET", "/readyz", None).status, 0);
    assert_eq!(get_from(&lab, &host, &user, "/api/v1/nodes"), 0);
    kube.start_apiserver();
    assert_eq!(get_from(&lab, &host, &user, "/api/v1/nodes"), 200);
    assert_eq!(kube.flannel_annotation("node-1", "backend-type").as_deref(), Some("vxlan"));
    kube.delete_node("node-1");
    assert!(kube.node("node-1").is_none());
}
