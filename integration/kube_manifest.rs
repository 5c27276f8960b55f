//! `deploy/kube-weft.yml` against a real API server (kube-apiserver v1.20.2 on loopback,
//! support/kube.rs): the server accepts every object (`kubectl apply --dry-run=server`), the
//! ClusterRole is exactly flannel's, and the real RBAC authorizer grants weft's service account
//! that and nothing more.
//!
//! `cargo test --features kube --test kube_manifest` (after `scripts/kube-apiserver.sh build`;
//! no root).

mod support;

use std::collections::BTreeSet;

use serde_json::Value;
use support::kube::{
    KubeApi, MANIFEST, MANIFEST_NAMESPACE as NAMESPACE, MANIFEST_SERVICE_ACCOUNT as SERVICE_ACCOUNT,
};

/// flannel's rules (kube-flannel.yml), as (resource, verbs), all in the core API group: what
/// weft's Kubernetes subnet manager uses and all it may.
const FLANNEL_RULES: &[(&str, &[&str])] =
    &[("pods", &["get"]), ("nodes", &["get", "list", "watch"]), ("nodes/status", &["patch"])];

fn kubectl_ok(kube: &KubeApi, args: &[&str]) -> String {
    let out = kube.kubectl(args);
    assert!(
        out.status.success(),
        "kubectl {args:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The manifest's namespace, made for real: a server-side dry run creates nothing, so the
/// objects in a namespace the same run would create are refused ("namespaces not found").
/// With it there, every object of the manifest still goes through the dry run (the
/// Namespace as an apply to an existing one).
fn dry_run_namespace(kube: &KubeApi) {
    kube.create_namespace(NAMESPACE);
}

/// The manifest's objects as the server reads them (a server-side dry run, `-o json`).
fn objects(kube: &KubeApi) -> Vec<Value> {
    dry_run_namespace(kube);
    let out = kubectl_ok(kube, &["apply", "--dry-run=server", "-o", "json", "-f", MANIFEST]);
    // A List (kubectl 1.32), or one object after another (Debian's 1.20).
    let mut objects = Vec::new();
    for v in serde_json::Deserializer::from_str(&out).into_iter::<Value>() {
        let v = v.expect("kubectl -o json");
        match v["kind"].as_str() {
            Some("List") => objects.extend(v["items"].as_array().expect("items").iter().cloned()),
            _ => objects.push(v),
        }
    }
    objects
}

fn find<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

fn one<'a>(objects: &'a [Value], kind: &str) -> &'a Value {
    let found = find(objects, kind);
    assert_eq!(found.len(), 1, "the manifest must have exactly one {kind}");
    found[0]
}

/// (group, resource, verb) triples a list of RBAC rules grants; panics on anything a triple
/// cannot say (resourceNames, nonResourceURLs, wildcards).
fn grants(rules: &Value) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for rule in rules.as_array().expect("rules") {
        for field in ["resourceNames", "nonResourceURLs"] {
            assert!(rule.get(field).is_none(), "a rule with {field}: {rule}");
        }
        let list = |f: &str| -> Vec<String> {
            rule[f]
                .as_array()
                .unwrap_or_else(|| panic!("rule without {f}: {rule}"))
                .iter()
                .map(|s| s.as_str().expect("string").to_owned())
                .collect()
        };
        for group in list("apiGroups") {
            for resource in list("resources") {
                for verb in list("verbs") {
                    assert!(
                        !(group.contains('*') || resource.contains('*') || verb.contains('*')),
                        "a wildcard in {rule}"
                    );
                    out.insert((group.clone(), resource.clone(), verb));
                }
            }
        }
    }
    out
}

fn flannel_grants() -> BTreeSet<(String, String, String)> {
    FLANNEL_RULES
        .iter()
        .flat_map(|(r, verbs)| {
            verbs.iter().map(move |v| (String::new(), r.to_string(), v.to_string()))
        })
        .collect()
}

#[test]
fn the_manifest_passes_the_servers_dry_run() {
    let kube = KubeApi::on_loopback();
    dry_run_namespace(&kube);
    let out = kubectl_ok(&kube, &["apply", "--dry-run=server", "-f", MANIFEST]);
    // One line per object, each accepted by the server.
    let lines: Vec<&str> = out.lines().collect();
    for object in [
        "namespace/kube-weft",
        "serviceaccount/weft",
        "clusterrole.rbac.authorization.k8s.io/weft",
        "clusterrolebinding.rbac.authorization.k8s.io/weft",
        "configmap/kube-weft-cfg",
        "daemonset.apps/kube-weft-ds",
    ] {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&format!("{object} ")) && l.ends_with("(server dry run)")),
            "{object} not accepted by the server's dry run:\n{out}"
        );
    }
    assert_eq!(lines.len(), 6, "exactly the six objects:\n{out}");
}

#[test]
fn the_cluster_role_is_exactly_flannels_and_bound_to_the_daemonsets_account() {
    let kube = KubeApi::on_loopback();
    let objects = objects(&kube);
    let role = one(&objects, "ClusterRole");
    assert_eq!(grants(&role["rules"]), flannel_grants(), "ClusterRole rules: {}", role["rules"]);
    assert!(find(&objects, "Role").is_empty() && find(&objects, "RoleBinding").is_empty());

    let binding = one(&objects, "ClusterRoleBinding");
    assert_eq!(binding["roleRef"]["kind"], "ClusterRole");
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    let subjects = binding["subjects"].as_array().expect("subjects");
    assert_eq!(subjects.len(), 1, "one subject: {subjects:?}");
    assert_eq!(subjects[0]["kind"], "ServiceAccount");
    assert_eq!(subjects[0]["name"], SERVICE_ACCOUNT);
    assert_eq!(subjects[0]["namespace"], NAMESPACE);

    let sa = one(&objects, "ServiceAccount");
    assert_eq!(sa["metadata"]["name"], SERVICE_ACCOUNT);
    assert_eq!(sa["metadata"]["namespace"], NAMESPACE);
    let ds = one(&objects, "DaemonSet");
    assert_eq!(ds["metadata"]["namespace"], NAMESPACE);
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], SERVICE_ACCOUNT);
    assert_eq!(pod["hostNetwork"], true);

    // The container: weft's flags, non-root, NET_ADMIN and NET_RAW and nothing else.
    let containers = pod["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 1);
    let weft = &containers[0];
    let args: Vec<&str> =
        weft["args"].as_array().expect("args").iter().filter_map(Value::as_str).collect();
    for flag in [
        "--kube-subnet-mgr",
        "--healthz-port=8081",
        "--net-config-path=/etc/kube-flannel/net-conf.json",
    ] {
        assert!(args.contains(&flag), "{flag} not in {args:?}");
    }
    let sc = &weft["securityContext"];
    assert_eq!(sc["runAsNonRoot"], true);
    assert_ne!(sc["runAsUser"], 0);
    assert_ne!(sc["privileged"], true);
    assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
    assert_eq!(sc["capabilities"]["add"], serde_json::json!(["NET_ADMIN", "NET_RAW"]));
    let env = weft["env"].as_array().expect("env");
    let node_name = env.iter().find(|e| e["name"] == "NODE_NAME").expect("NODE_NAME");
    assert_eq!(node_name["valueFrom"]["fieldRef"]["fieldPath"], "spec.nodeName");
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        assert_eq!(weft[probe]["httpGet"]["path"], path, "{probe}");
        assert_eq!(weft[probe]["httpGet"]["port"], "healthz", "{probe}");
    }
    let port = &weft["ports"][0];
    assert_eq!(
        (port["name"].as_str(), port["containerPort"].as_u64()),
        (Some("healthz"), Some(8081))
    );

    // The ConfigMap the container reads its network config from.
    let cm = one(&objects, "ConfigMap");
    let net: Value =
        serde_json::from_str(cm["data"]["net-conf.json"].as_str().expect("net-conf.json"))
            .expect("net-conf.json is JSON");
    assert_eq!(net["Network"], "10.244.0.0/16");
    assert_eq!(net["Backend"]["Type"], "vxlan");
    let cni: Value =
        serde_json::from_str(cm["data"]["cni-conf.json"].as_str().expect("cni-conf.json"))
            .expect("cni-conf.json is JSON");
    let types: Vec<&str> = cni["plugins"]
        .as_array()
        .expect("plugins")
        .iter()
        .filter_map(|p| p["type"].as_str())
        .collect();
    assert_eq!(types, ["flannel", "portmap"]);
}

#[test]
fn the_authorizer_grants_weft_flannels_rules_and_nothing_more() {
    let kube = KubeApi::on_loopback();
    // For real this time: the RBAC objects (and the rest; no controller runs the DaemonSet).
    kube.apply_manifest();
    let user = format!("system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}");
    for (resource, verbs) in FLANNEL_RULES {
        for verb in *verbs {
            assert!(kube.can(&user, verb, resource), "{user} may not {verb} {resource}");
        }
    }
    for (verb, resource) in [
        ("patch", "nodes"),
        ("update", "nodes"),
        ("create", "nodes"),
        ("delete", "nodes"),
        ("update", "nodes/status"),
        ("get", "nodes/proxy"),
        ("list", "pods"),
        ("watch", "pods"),
        ("patch", "pods"),
        ("get", "secrets"),
        ("list", "configmaps"),
        ("create", "events"),
    ] {
        assert!(
            !kube.can(&user, verb, resource),
            "{user} may {verb} {resource}: more than flannel's rules"
        );
    }

    // The calls themselves, with the service account's own token, as weft makes them.
    kube.create_node("node-a", &["10.244.1.0/24"]);
    let kubeconfig = kube.dir().join("weft.kubeconfig");
    kube.manifest_kubeconfig(&kubeconfig, nix::unistd::getuid().as_raw());
    let as_weft = |args: &[&str]| {
        let mut all = vec!["--kubeconfig", kubeconfig.to_str().expect("utf-8 path")];
        all.extend_from_slice(args);
        kube.kubectl(&all)
    };
    assert!(as_weft(&["get", "nodes", "-o", "name"]).status.success());
    let out = as_weft(&["label", "node", "node-a", "x=y"]);
    assert!(!out.status.success(), "weft's account changed a node's labels");
    assert!(String::from_utf8_lossy(&out.stderr).contains("forbidden"), "{out:?}");
}
