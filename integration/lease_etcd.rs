//! The lease scenarios of docs/scenarios.md against a real etcd, with real `weft run` processes:
//! SIGSTOP for a suspended host, SIGKILL for a crash, a cut TCP proxy for a partition, short
//! TTLs (4 s). S11 runs on a three-member etcd cluster.
//!
//! Each test starts its own etcd (loopback, random ports, temp dir) and uses a fresh prefix.
//! Hosts publish addresses from 192.0.2.0/24; nothing here touches a network interface.

mod support;

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use etcd_client::{Client, GetOptions};
use support::etcd::{EtcdCluster, EtcdServer, unique_prefix};
use support::weft::{NodeOptions, Proxy, WeftNode, lease_list_json, weft_cli};

const READY: Duration = Duration::from_secs(20);

fn ip(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(192, 0, 2, n)
}

fn sleep(secs: f64) {
    std::thread::sleep(Duration::from_secs_f64(secs));
}

/// A hook's output file, once it exists (hooks run asynchronously), waiting up to 5 s.
fn read_when_written(path: &std::path::Path) -> Option<String> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !path.exists() && Instant::now() < deadline {
        sleep(0.1);
    }
    std::fs::read_to_string(path).ok()
}

/// Writes the network config with `weft network set` (so the CLI is exercised too).
fn set_network(endpoints: &str, prefix: &str, json: &str) {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("net.json");
    std::fs::write(&f, json).unwrap();
    let (code, out, err) = weft_cli(&[
        "network",
        "set",
        f.to_str().unwrap(),
        "--etcd-endpoints",
        endpoints,
        "--etcd-prefix",
        prefix,
    ]);
    assert_eq!(code, 0, "weft network set failed: {out} {err}");
}

/// A network of exactly the subnets 10.244.1.0/24 ..= 10.244.<n>.0/24.
fn network_of(n: u8) -> String {
    format!(
        r#"{{"Network":"10.244.0.0/16","SubnetLen":24,"SubnetMin":"10.244.1.0","SubnetMax":"10.244.{n}.0","Backend":{{"Type":"vxlan"}}}}"#
    )
}

/// [`network_of`], dual-stack, as flannel's udp backend serves it (weft's too: both halves are
/// leased, IPv4 is carried): `EnableIPv6` with `fd00:10:244::/56` in /64s.
fn dual_network_of(n: u8) -> String {
    format!(
        r#"{{"Network":"10.244.0.0/16","SubnetLen":24,"SubnetMin":"10.244.1.0","SubnetMax":"10.244.{n}.0","EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{{"Type":"udp"}}}}"#
    )
}

/// The key of `subnet` alone: `10.244.1.0-24`, or an IPv6-only lease's `0.0.0.0-0&<v6>-<len>`.
fn key_of(prefix: &str, subnet: &str) -> String {
    match subnet.contains(':') {
        true => format!("{prefix}/subnets/0.0.0.0-0&{}", subnet.replacen('/', "-", 1)),
        false => format!("{prefix}/subnets/{}", subnet.replace('/', "-")),
    }
}

/// A node's options on `network`: on an IPv6-only one, with its IPv6 underlay address
/// (2001:db8::<n>) given.
fn options_on(network: &str, endpoint: String, prefix: &str, n: u8) -> NodeOptions {
    let mut o = NodeOptions::new(endpoint, prefix, ip(n));
    if network.contains(r#""EnableIPv4":false"#) {
        o.extra = vec!["--public-ipv6".into(), format!("2001:db8::{n}")];
    }
    o
}

/// The live key of `subnet` in either form (`X`, or a dual-stack `X&<v6>`): its full name, its
/// IPv6 half as `addr/len` if any, its value and its mod revision.
async fn lease_of(
    c: &mut Client,
    prefix: &str,
    subnet: &str,
) -> Option<(String, Option<String>, serde_json::Value, i64)> {
    let v4 = key_of(prefix, subnet);
    let r = c.get(v4.clone(), Some(GetOptions::new().with_prefix())).await.unwrap();
    r.kvs().iter().find_map(|kv| {
        let key = kv.key_str().ok()?;
        // `&fd00:10:244:5::-64` → `fd00:10:244:5::/64` (IPv6 text has no '-'); an IPv6-only
        // lease's half is its subnet.
        let half = match key.strip_prefix(&v4)? {
            "" if subnet.contains(':') => Some(subnet.to_owned()),
            "" => None,
            rest => Some(rest.strip_prefix('&')?.replacen('-', "/", 1)),
        };
        Some((key.to_owned(), half, serde_json::from_slice(kv.value()).ok()?, kv.mod_revision()))
    })
}

/// A subnet key's value (as JSON) and mod revision.
async fn read_key(c: &mut Client, key: &str) -> Option<(serde_json::Value, i64)> {
    let r = c.get(key, None).await.unwrap();
    let kv = r.kvs().first()?;
    Some((serde_json::from_slice(kv.value()).unwrap(), kv.mod_revision()))
}

async fn subnet_keys(c: &mut Client, prefix: &str) -> Vec<(String, serde_json::Value)> {
    let r =
        c.get(format!("{prefix}/subnets/"), Some(GetOptions::new().with_prefix())).await.unwrap();
    r.kvs()
        .iter()
        .map(|kv| {
            (
                kv.key_str().unwrap().to_owned(),
                serde_json::from_slice(kv.value()).unwrap_or(serde_json::Value::Null),
            )
        })
        .collect()
}

fn node_id(v: &serde_json::Value) -> String {
    v["WeftNodeID"].as_str().unwrap_or_default().to_owned()
}

fn state_node_id(n: &WeftNode) -> String {
    std::fs::read_to_string(n.dir().join("state/node-id")).unwrap().trim().to_owned()
}

#[tokio::test]
async fn s1_suspended_host_comes_back_and_reclaims_its_subnet() {
    s1(&network_of(20), false).await;
}

#[tokio::test]
async fn s1_dual_stack_suspended_host_comes_back_and_reclaims_both_halves() {
    s1(&dual_network_of(20), true).await;
}

/// The IPv6 half a node's subnet.env names: there exactly on a dual-stack network, and the
/// half its key carries.
async fn checked_half(
    c: &mut Client,
    prefix: &str,
    n: &WeftNode,
    s: &str,
    dual: bool,
) -> Option<String> {
    let half = n.subnet_env_ipv6();
    assert_eq!(half.is_some(), dual, "FLANNEL_IPV6_SUBNET: {half:?}");
    let (key, key_half, _, _) = lease_of(c, prefix, s).await.expect("the node's key");
    assert_eq!(key_half, half, "{key} and subnet.env disagree");
    half
}

async fn s1(network: &str, dual: bool) {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    set_network(&etcd.endpoint(), &prefix, network);
    let a = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(1)));
    let s = a.wait_ready(READY);
    let mut c = etcd.client().await;
    let half = checked_half(&mut c, &prefix, &a, &s, dual).await;
    a.suspend();
    sleep(6.0); // past the 4 s TTL
    assert!(lease_of(&mut c, &prefix, &s).await.is_none(), "A's key should have expired");
    let b = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(2)));
    let sb = b.wait_ready(READY);
    assert_ne!(sb, s, "B must prefer never-used subnets over A's expired one");
    let b_half = checked_half(&mut c, &prefix, &b, &sb, dual).await;
    assert!(!dual || b_half != half, "B took A's IPv6 half");
    a.resume();
    a.wait_log("recovered", Duration::from_secs(10));
    a.wait_ready(READY);
    assert_eq!(
        a.subnet_env_subnet().as_deref(),
        Some(s.as_str()),
        "same subnet, subnet.env unchanged"
    );
    let (_, _, v, _) = lease_of(&mut c, &prefix, &s).await.expect("A's key is back");
    assert_eq!(node_id(&v), state_node_id(&a));
    assert_eq!(checked_half(&mut c, &prefix, &a, &s, dual).await, half, "both halves came back");
    let log = a.log();
    assert!(!log.contains("subnet changed") && !log.contains("LEASE LOST"), "{log}");
    assert_eq!(a.metric("weft_lease_recoveries_total"), Some(1.0));
}

/// An IPv6-only network (`"EnableIPv4": false`) of IPv6 /64s, vxlan.
const IPV6_ONLY_NETWORK: &str = r#"{"EnableIPv4":false,"EnableIPv6":true,"IPv6Network":"fd00:10:244::/56","Backend":{"Type":"vxlan"}}"#;

/// A node on an IPv6-only network: its IPv6 underlay address is 2001:db8::<n>.
fn ipv6_only_node(
    etcd: &EtcdServer,
    prefix: &str,
    n: u8,
    dir: Option<std::path::PathBuf>,
) -> WeftNode {
    let mut o = NodeOptions::new(etcd.endpoint(), prefix, ip(n));
    o.extra = vec!["--public-ipv6".into(), format!("2001:db8::{n}")];
    o.dir = dir;
    WeftNode::spawn(o)
}

/// On an IPv6-only network each node leases an IPv6 subnet under flannel's key form
/// (`0.0.0.0-0&<v6>-<len>`, `PublicIP` 0.0.0.0, `BackendV6Data` only), subnet.env has the IPv6
/// pair alone, and the lease rules hold as on any network: two nodes never share a subnet (not
/// even with equal, empty PublicIPs, the way flannel's second IPv6-only node takes the first's),
/// a restart keeps the subnet (S3), a suspended node past its TTL comes back to it (S1), and a
/// relinquishing node's key goes.
#[tokio::test]
async fn ipv6_only_network_leases_in_flannels_key_form_under_the_same_rules() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    set_network(&etcd.endpoint(), &prefix, IPV6_ONLY_NETWORK);
    let mut a = ipv6_only_node(&etcd, &prefix, 1, None);
    let sa = a.wait_ready(READY);
    let b = ipv6_only_node(&etcd, &prefix, 2, None);
    let sb = b.wait_ready(READY);
    assert_ne!(sa, sb, "two IPv6-only nodes share a subnet");
    let mut c = etcd.client().await;
    let keys = subnet_keys(&mut c, &prefix).await;
    assert_eq!(keys.len(), 2, "{keys:?}");
    for (node, s, n) in [(&a, &sa, 1), (&b, &sb, 2)] {
        assert!(s.starts_with("fd00:10:244:") && s.ends_with("/64"), "{s}");
        let key = format!("{prefix}/subnets/0.0.0.0-0&{}", s.replacen('/', "-", 1));
        let (v, _) = read_key(&mut c, &key).await.unwrap_or_else(|| panic!("no {key}: {keys:?}"));
        assert_eq!(v["PublicIP"], "0.0.0.0", "{v}");
        assert_eq!(v["PublicIPv6"], format!("2001:db8::{n}"), "{v}");
        assert_eq!(v["BackendType"], "vxlan", "{v}");
        assert!(v["BackendV6Data"]["VtepMAC"].is_string(), "{v}");
        assert!(v.get("BackendData").is_none(), "an IPv6-only lease has no BackendData: {v}");
        assert_eq!(node_id(&v), state_node_id(node));
        let env = std::fs::read_to_string(node.subnet_file()).unwrap();
        assert!(!env.contains("FLANNEL_NETWORK=") && !env.contains("FLANNEL_SUBNET="), "{env}");
        assert!(env.starts_with("FLANNEL_IPV6_NETWORK=fd00:10:244::/56\n"), "{env}");
        assert_eq!(node.subnet_env_ipv6().as_deref(), Some(s.as_str()));
    }
    let list = lease_list_json(&etcd.endpoint(), &prefix);
    let listed: Vec<&str> =
        list["leases"].as_array().unwrap().iter().filter_map(|l| l["subnet"].as_str()).collect();
    assert!(listed.contains(&sa.as_str()) && listed.contains(&sb.as_str()), "{list}");
    // S3: a restart keeps the subnet.
    assert_eq!(a.stop(), Some(0));
    let dir = a.dir().to_path_buf();
    let a = ipv6_only_node(&etcd, &prefix, 1, Some(dir));
    assert_eq!(a.wait_ready(READY), sa, "a restart keeps the IPv6-only subnet");
    // S1: suspended past its TTL, the key expires; resumed, the node takes it back.
    a.suspend();
    sleep(6.0);
    assert_eq!(subnet_keys(&mut c, &prefix).await.len(), 1, "A's key should have expired");
    a.resume();
    a.wait_log("recovered", Duration::from_secs(10));
    assert_eq!(a.wait_ready(READY), sa, "the same subnet came back");
    // Relinquished: the key goes.
    let mut b = b;
    assert_eq!(b.stop(), Some(0));
    let mut o = NodeOptions::new(etcd.endpoint(), &prefix, ip(2));
    o.extra = vec!["--public-ipv6".into(), "2001:db8::2".into(), "--relinquish-on-exit".into()];
    o.dir = Some(b.dir().to_path_buf());
    let mut b2 = WeftNode::spawn(o);
    assert_eq!(b2.wait_ready(READY), sb);
    assert_eq!(b2.stop(), Some(0));
    let left: Vec<String> =
        subnet_keys(&mut c, &prefix).await.into_iter().map(|(k, _)| k).collect();
    assert_eq!(left, [format!("{prefix}/subnets/0.0.0.0-0&{}", sa.replacen('/', "-", 1))]);
}

#[tokio::test]
async fn s2_suspended_host_finds_its_subnet_taken_reports_loudly_and_moves() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    set_network(&etcd.endpoint(), &prefix, &network_of(2));
    let hooks = tempfile::tempdir().unwrap();
    let lost = hooks.path().join("lost");
    let changed = hooks.path().join("changed");
    let mut opts = NodeOptions::new(etcd.endpoint(), &prefix, ip(1));
    opts.extra = vec![
        "--on-lease-lost".into(),
        format!("echo \"$1 $WEFT_REASON $WEFT_HOLDER\" > {}", lost.display()),
        "--on-subnet-change".into(),
        format!("echo \"$1 $2\" > {}", changed.display()),
    ];
    let a = WeftNode::spawn(opts);
    let s = a.wait_ready(READY);
    let mut cnode = WeftNode::spawn({
        let mut o = NodeOptions::new(etcd.endpoint(), &prefix, ip(3));
        o.extra = vec!["--relinquish-on-exit".into()];
        o
    });
    let other = cnode.wait_ready(READY);
    let mut c = etcd.client().await;
    a.suspend();
    sleep(6.0);
    let b = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(2)));
    assert_eq!(b.wait_ready(READY), s, "B takes the only free subnet: A's expired one");
    let (_, b_rev) = read_key(&mut c, &key_of(&prefix, &s)).await.unwrap();
    a.resume();
    a.wait_log("LEASE LOST", Duration::from_secs(10));
    assert!(a.log().contains("192.0.2.2"), "the loss names B's address:\n{}", a.log());
    a.wait_log("network exhausted", Duration::from_secs(10));
    let (code, body) = a.get("/readyz");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("exhausted"), "{body}");
    assert_eq!(a.metric("weft_lease_losses_total"), Some(1.0));
    // The hook ran with the old subnet, the reason and the new holder.
    let hook = read_when_written(&lost).expect("on-lease-lost ran");
    assert_eq!(hook.trim(), format!("{s} taken-by-another-node 192.0.2.2"));
    // B keeps S untouched.
    let (v, rev) = read_key(&mut c, &key_of(&prefix, &s)).await.unwrap();
    assert_eq!(node_id(&v), state_node_id(&b));
    assert!(rev >= b_rev);
    assert_eq!(v["PublicIP"], "192.0.2.2");
    // A subnet frees up: A takes it, rewrites subnet.env, runs the subnet-change hook.
    assert_eq!(cnode.stop(), Some(0));
    let news = a.wait_ready(READY);
    assert_eq!(news, other);
    assert_eq!(
        read_when_written(&changed).expect("on-subnet-change ran").trim(),
        format!("{s} {other}")
    );
    // B never saw a write from A.
    let (v2, _) = read_key(&mut c, &key_of(&prefix, &s)).await.unwrap();
    assert_eq!(node_id(&v2), state_node_id(&b));
}

#[tokio::test]
async fn s3_restart_with_stale_subnet_env_never_takes_the_new_holders_subnet() {
    s3(&network_of(1), false).await;
}

#[tokio::test]
async fn s3_dual_stack_restart_with_stale_subnet_env_never_takes_the_new_holders_subnet() {
    s3(&dual_network_of(1), true).await;
}

async fn s3(network: &str, dual: bool) {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    set_network(&etcd.endpoint(), &prefix, network);
    let mut a = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(1)));
    let s = a.wait_ready(READY);
    let mut c = etcd.client().await;
    let a_half = checked_half(&mut c, &prefix, &a, &s, dual).await;
    a.kill();
    sleep(5.0);
    let b = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(2)));
    assert_eq!(b.wait_ready(READY), s);
    // B took the expired subnet with the IPv6 half that went with it.
    assert_eq!(checked_half(&mut c, &prefix, &b, &s, dual).await, a_half);
    let (b_key, _, before_value, _) = lease_of(&mut c, &prefix, &s).await.unwrap();
    let before = (before_value, ());
    a.start(); // subnet.env still names S
    a.wait_log("network exhausted", Duration::from_secs(15));
    a.wait_log("previous subnet", Duration::from_secs(1));
    // Across A's whole run the key stays B's: same value, and only B's renewals move it.
    for _ in 0..6 {
        let (key, _, v, _) = lease_of(&mut c, &prefix, &s).await.unwrap();
        assert_eq!(key, b_key);
        assert_eq!(node_id(&v), node_id(&before.0));
        assert_eq!(v["PublicIP"], "192.0.2.2");
        sleep(0.5);
    }
    assert_eq!(a.get("/readyz").0, 503);
    assert!(a.running());
}

#[tokio::test]
async fn s4_cloned_host_does_not_hijack_and_the_clash_is_loud() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    set_network(&etcd.endpoint(), &prefix, &network_of(20));
    let a = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(1)));
    let s = a.wait_ready(READY);
    let mut c = etcd.client().await;
    let (before, _) = read_key(&mut c, &key_of(&prefix, &s)).await.unwrap();
    // B is a copy of A's disk: same state dir (node ID, VTEP MAC) and subnet.env.
    let clone_dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(clone_dir.path().join("state")).unwrap();
    for f in ["state/node-id", "state/vtep-mac", "subnet.env"] {
        std::fs::copy(a.dir().join(f), clone_dir.path().join(f)).unwrap();
    }
    let mut opts = NodeOptions::new(etcd.endpoint(), &prefix, ip(2));
    opts.dir = Some(clone_dir.path().to_path_buf());
    let b = WeftNode::spawn(opts);
    b.wait_log("IDENTITY CLASH", Duration::from_secs(15));
    assert_eq!(b.get("/readyz").0, 503);
    assert!(b.get("/readyz").1.contains("clone"));
    assert_eq!(b.metric("weft_identity_clashes_total"), Some(1.0));
    // A keeps S: the key still carries A's incarnation, across several renewals.
    for _ in 0..6 {
        let (v, _) = read_key(&mut c, &key_of(&prefix, &s)).await.unwrap();
        assert_eq!(v["WeftIncarnation"], before["WeftIncarnation"]);
        assert_eq!(v["PublicIP"], "192.0.2.1");
        sleep(1.0);
    }
    assert_eq!(a.get("/readyz").0, 200);
    assert_eq!(subnet_keys(&mut c, &prefix).await.len(), 1, "never a second key for the clone");
    // The clash is loud but not terminal: once the original is gone (crashed, its presence
    // expired), the clone takes over the identity, and its subnet.
    let mut a = a;
    a.kill();
    assert_eq!(b.wait_ready(READY), s);
    b.wait_log("identity clash over", Duration::from_secs(1));
    let (v, _) = read_key(&mut c, &key_of(&prefix, &s)).await.unwrap();
    assert_eq!(v["PublicIP"], "192.0.2.2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_restart_is_never_a_clash_even_below_etcds_minimum_ttl() {
    // --subnet-lease-ttl 1s makes a 0.5 s presence TTL; etcd grants no lease under its minimum
    // (about 2 s with its default timing) and revokes late, so a crashed process's presence key
    // stands well past three presence TTLs, which used to count as proof of a clone.
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    set_network(&etcd.endpoint(), &prefix, &network_of(20));
    let mut opts = NodeOptions::new(etcd.endpoint(), &prefix, ip(1));
    opts.ttl = "1s".into();
    let mut a = WeftNode::spawn(opts);
    let s = a.wait_ready(READY);
    for round in 0..3 {
        a.kill();
        a.start();
        assert_eq!(a.wait_ready(READY), s, "round {round}");
        assert!(!a.log().contains("IDENTITY CLASH"), "round {round}: {}", a.log());
    }
}

#[tokio::test]
async fn s5_partition_longer_than_the_ttl_keeps_the_subnet_and_recovers() {
    s5(&network_of(20), false).await;
}

#[tokio::test]
async fn s5_dual_stack_partition_longer_than_the_ttl_keeps_both_halves_and_recovers() {
    s5(&dual_network_of(20), true).await;
}

#[tokio::test]
async fn s5_ipv6_only_partition_longer_than_the_ttl_keeps_the_subnet_and_recovers() {
    s5(IPV6_ONLY_NETWORK, true).await;
}

async fn s5(network: &str, dual: bool) {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    set_network(&etcd.endpoint(), &prefix, network);
    let proxy = Proxy::start(SocketAddr::from((Ipv4Addr::LOCALHOST, etcd.client_port())));
    let a = WeftNode::spawn(options_on(network, proxy.endpoint(), &prefix, 1));
    let s = a.wait_ready(READY);
    let mut c = etcd.client().await;
    let half = checked_half(&mut c, &prefix, &a, &s, dual).await;
    let b = WeftNode::spawn(options_on(network, etcd.endpoint(), &prefix, 2));
    b.wait_ready(READY);
    proxy.cut(true);
    sleep(12.0); // three TTLs
    assert!(lease_of(&mut c, &prefix, &s).await.is_none(), "A's key expired in etcd");
    let (code, body) = a.get("/readyz");
    assert_eq!(code, 503, "{body}");
    assert!(a.get("/healthz").0 == 200, "A still runs");
    proxy.cut(false);
    a.wait_log("recovered", Duration::from_secs(15));
    assert_eq!(a.wait_ready(READY), s);
    assert_eq!(checked_half(&mut c, &prefix, &a, &s, dual).await, half);
    assert_eq!(b.get("/readyz").0, 200);
    assert!(!a.log().contains("LEASE LOST"));
}

#[tokio::test]
async fn s6_short_outage_around_renewal_renews_and_logs_nothing_above_warning() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    set_network(&etcd.endpoint(), &prefix, &network_of(20));
    let proxy = Proxy::start(SocketAddr::from((Ipv4Addr::LOCALHOST, etcd.client_port())));
    let a = WeftNode::spawn(NodeOptions::new(proxy.endpoint(), &prefix, ip(1)));
    let s = a.wait_ready(READY);
    let renewals = a.metric("weft_lease_renewals_total").unwrap_or(0.0);
    // Renewal is due 2 s after acquiring: cut from ~1.3 s to ~3 s after, less than TTL/2.
    sleep(1.3);
    proxy.cut(true);
    sleep(1.7);
    proxy.cut(false);
    sleep(3.0);
    assert!(
        a.metric("weft_lease_renewals_total").unwrap_or(0.0) > renewals,
        "renewed after the outage"
    );
    assert_eq!(a.subnet_env_subnet().as_deref(), Some(s.as_str()));
    assert_eq!(a.get("/readyz").0, 200);
    let log = a.log();
    assert!(!log.contains("ERROR"), "nothing above warning:\n{log}");
}

#[tokio::test]
async fn s7_fifty_hosts_join_at_once_and_all_get_distinct_subnets() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    // 60 subnets for 50 hosts: crowded, so races happen.
    set_network(&etcd.endpoint(), &prefix, &network_of(60));
    let nodes: Vec<WeftNode> = (1..=50)
        .map(|i| {
            let mut o = NodeOptions::new(etcd.endpoint(), &prefix, ip(i));
            o.ttl = "30s".into();
            WeftNode::spawn(o)
        })
        .collect();
    let start = Instant::now();
    let mut subnets: Vec<String> =
        nodes.iter().map(|n| n.wait_ready(Duration::from_secs(60))).collect();
    eprintln!("50 hosts ready in {:?}", start.elapsed());
    subnets.sort();
    subnets.dedup();
    assert_eq!(subnets.len(), 50, "every host a distinct subnet");
    let mut c = etcd.client().await;
    assert_eq!(subnet_keys(&mut c, &prefix).await.len(), 50);
    for mut n in nodes {
        assert!(n.running(), "no host exits on a lost race");
    }
}

#[tokio::test]
async fn s8_clean_shutdown_relinquishes_and_a_new_host_prefers_it() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    set_network(&etcd.endpoint(), &prefix, &network_of(2));
    // X takes one subnet and crashes: its subnet expires (older history).
    let mut x = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(9)));
    let sx = x.wait_ready(READY);
    let mut o = NodeOptions::new(etcd.endpoint(), &prefix, ip(1));
    o.extra = vec!["--relinquish-on-exit".into()];
    let mut a = WeftNode::spawn(o);
    let s = a.wait_ready(READY);
    assert_ne!(s, sx);
    x.kill();
    sleep(5.0);
    let mut c = etcd.client().await;
    assert!(read_key(&mut c, &key_of(&prefix, &sx)).await.is_none());
    assert_eq!(a.stop(), Some(0));
    assert!(
        read_key(&mut c, &key_of(&prefix, &s)).await.is_none(),
        "key gone at once, not after the TTL"
    );
    let list = lease_list_json(&etcd.endpoint(), &prefix);
    let entry = list["leases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["subnet"] == s.as_str())
        .unwrap()
        .clone();
    assert_eq!(entry["history"], "relinquished");
    let b = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(2)));
    assert_eq!(b.wait_ready(READY), s, "relinquished beats expired");
}

#[tokio::test]
async fn s9_operator_revoke_is_noticed_within_a_second_and_reclaimed() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    set_network(&etcd.endpoint(), &prefix, &network_of(20));
    let a = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(1)));
    let s = a.wait_ready(READY);
    let (code, _, err) = weft_cli(&[
        "lease",
        "revoke",
        &s,
        "--etcd-endpoints",
        &etcd.endpoint(),
        "--etcd-prefix",
        &prefix,
    ]);
    assert_eq!(code, 0, "{err}");
    let t = Instant::now();
    a.wait_log("recovered", Duration::from_secs(5));
    assert!(t.elapsed() < Duration::from_millis(1500), "noticed in {:?}", t.elapsed());
    let mut c = etcd.client().await;
    let (v, _) = read_key(&mut c, &key_of(&prefix, &s)).await.expect("reclaimed");
    assert_eq!(node_id(&v), state_node_id(&a));
}

#[tokio::test]
async fn s10_public_ip_change_across_restart_keeps_the_subnet() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    set_network(&etcd.endpoint(), &prefix, &network_of(20));
    let mut a = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(1)));
    let s = a.wait_ready(READY);
    let mut c = etcd.client().await;
    let (_, rev) = read_key(&mut c, &key_of(&prefix, &s)).await.unwrap();
    assert_eq!(a.stop(), Some(0));
    a.opts.public_ip = ip(77);
    a.start();
    assert_eq!(a.wait_ready(READY), s);
    let (v, rev2) = read_key(&mut c, &key_of(&prefix, &s)).await.unwrap();
    assert_eq!(v["PublicIP"], "192.0.2.77");
    assert!(rev2 > rev);
    assert!(a.log().contains("adopted"), "{}", a.log());
}

#[tokio::test]
async fn s11_leader_loss_in_a_three_member_cluster_loses_nothing() {
    let mut cluster = EtcdCluster::start();
    let endpoints = cluster.endpoints().join(",");
    let prefix = unique_prefix();
    set_network(&endpoints, &prefix, &network_of(20));
    let mut nodes: Vec<WeftNode> = (1..=3)
        .map(|i| WeftNode::spawn(NodeOptions::new(endpoints.clone(), &prefix, ip(i))))
        .collect();
    for n in &nodes {
        n.wait_ready(READY);
    }
    let leader = cluster.leader_index().await.expect("a leader");
    cluster.kill_member(leader);
    // Joins and renewals while a new leader is elected.
    nodes.extend(
        (4..=6).map(|i| WeftNode::spawn(NodeOptions::new(endpoints.clone(), &prefix, ip(i)))),
    );
    sleep(8.0);
    let mut subnets: Vec<String> =
        nodes.iter().map(|n| n.wait_ready(Duration::from_secs(30))).collect();
    subnets.sort();
    subnets.dedup();
    assert_eq!(subnets.len(), 6);
    for n in &nodes {
        assert!(!n.log().contains("LEASE LOST"), "{}", n.log());
    }
    cluster.restart_member(leader);
}

#[tokio::test]
async fn s12_bad_store_input_is_named_skipped_and_never_crashes() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let mut c = etcd.client().await;
    // A malformed config: the daemon names the problem and waits; the CLI refuses to write one.
    c.put(format!("{prefix}/config"), r#"{"Network":"10.244.0.1/16"}"#, None).await.unwrap();
    let a = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(1)));
    a.wait_log("host bits", Duration::from_secs(10));
    assert_eq!(a.get("/readyz").0, 503);
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, r#"{"Network":"10.244.0.0/16","SubnetMin":"10.244.1.7"}"#).unwrap();
    let (code, _, err) = weft_cli(&[
        "network",
        "set",
        bad.to_str().unwrap(),
        "--etcd-endpoints",
        &etcd.endpoint(),
        "--etcd-prefix",
        &prefix,
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("SubnetMin"), "{err}");
    // Garbage leases: a non-JSON value on a valid key, an unparsable key, a misaligned key.
    c.put(format!("{prefix}/subnets/10.244.1.0-24"), "not json", None).await.unwrap();
    c.put(format!("{prefix}/subnets/bogus"), "{}", None).await.unwrap();
    c.put(format!("{prefix}/subnets/10.244.2.7-24"), r#"{"PublicIP":"192.0.2.50"}"#, None)
        .await
        .unwrap();
    set_network(&etcd.endpoint(), &prefix, &network_of(2));
    let s = a.wait_ready(READY);
    assert_eq!(s, "10.244.2.0/24", "never the subnet whose key holds garbage");
    // A value turned to garbage under a running node's watch does not crash it either.
    let b = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(2)));
    b.wait_log("network exhausted", Duration::from_secs(10));
    c.put(format!("{prefix}/subnets/{}", s.replace('/', "-")), "\u{0}\u{1}garbage", None)
        .await
        .unwrap();
    a.wait_log("LEASE LOST", Duration::from_secs(5));
    let (code, out, _) = weft_cli(&[
        "lease",
        "list",
        "--etcd-endpoints",
        &etcd.endpoint(),
        "--etcd-prefix",
        &prefix,
    ]);
    assert_eq!(code, 0);
    let ignored: Vec<&str> = out.lines().filter(|l| l.starts_with("ignored: ")).collect();
    assert!(ignored.iter().any(|l| l.contains("/subnets/bogus")), "{out}");
    assert!(ignored.iter().any(|l| l.contains("/subnets/10.244.1.0-24")), "{out}");
    let mut a = a;
    let mut b = b;
    assert!(a.running() && b.running());
}

// ---- Hostile store content: no store content can stop allocation or routing ---------------

/// `n` puts in transactions of at most 128 operations (etcd's default `--max-txn-ops`).
async fn put_many(c: &mut Client, kvs: impl IntoIterator<Item = (String, Vec<u8>)>) {
    use etcd_client::{Txn, TxnOp};
    let ops: Vec<TxnOp> = kvs.into_iter().map(|(k, v)| TxnOp::put(k, v, None)).collect();
    for chunk in ops.chunks(128) {
        c.txn(Txn::new().and_then(chunk.to_vec())).await.unwrap();
    }
}

fn lease_json(host: u8) -> String {
    format!(
        r#"{{"PublicIP":"192.0.2.{host}","BackendType":"vxlan","BackendData":{{"VNI":1,"VtepMAC":"02:00:00:00:00:{host:02x}"}}}}"#
    )
}

/// How often `needle` occurs in the node's log.
fn log_count(node: &WeftNode, needle: &str) -> usize {
    node.log().matches(needle).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_that_are_not_leases_neither_block_joins_nor_become_routes() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let mut c = etcd.client().await;
    set_network(&etcd.endpoint(), &prefix, &network_of(3));
    // What an operator's typo or a buggy tool leaves behind. flannel ignores all of these; the
    // first alone used to make every joining weft "network exhausted".
    let strays = [
        ("0.0.0.0-0", "anything".to_owned()),
        ("10.244.1.7-32", lease_json(60)),
        ("10.244.2.128-25", lease_json(61)),
        ("10.9.1.0-24", lease_json(62)),
        ("not-a-subnet", lease_json(63)),
    ];
    for (name, value) in &strays {
        c.put(format!("{prefix}/subnets/{name}"), value.as_str(), None).await.unwrap();
    }
    // flannel's dual-stack and IPv6-only keys are leases: the first holds 10.244.3.0/24; the
    // second is a lease of an IPv6-only network, foreign to this one (ignored like 10.9.1.0-24).
    c.put(format!("{prefix}/subnets/10.244.3.0-24&fd00:0:0:3::-64"), lease_json(70), None)
        .await
        .unwrap();
    c.put(format!("{prefix}/subnets/0.0.0.0-0&fd00:0:0:9::-64"), lease_json(71), None)
        .await
        .unwrap();

    let a = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(1)));
    let b = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(2)));
    let mut got = [a.wait_ready(READY), b.wait_ready(READY)];
    got.sort();
    assert_eq!(got, ["10.244.1.0/24", "10.244.2.0/24"], "the two free subnets, nothing else");

    // Each node routes to the other and to the dual-stack flannel lease, and to nothing stray.
    for node in [&a, &b] {
        let deadline = Instant::now() + Duration::from_secs(5);
        while node.metric("weft_routes") != Some(2.0) && Instant::now() < deadline {
            sleep(0.1);
        }
        assert_eq!(node.metric("weft_routes"), Some(2.0), "{}", node.log());
        assert_eq!(node.metric("weft_route_ignored_keys"), Some(strays.len() as f64 + 1.0));
    }
    // Renewals and re-lists come and go; each stray key is warned about once, by name.
    sleep(5.0);
    for (name, _) in &strays {
        let needle = format!("key=subnets/{name} ");
        assert_eq!(log_count(&a, &needle), 1, "{needle}\n{}", a.log());
    }
    let needle = "key=subnets/0.0.0.0-0&fd00:0:0:9::-64 ";
    assert_eq!(log_count(&a, needle), 1, "{needle}\n{}", a.log());
    assert!(a.log().contains("is not a lease of the IPv4 network 10.244.0.0/16"), "{}", a.log());

    let v = lease_list_json(&etcd.endpoint(), &prefix);
    let ignored: Vec<String> = v["ignored"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["key"].as_str().unwrap().rsplit('/').next().unwrap().to_owned())
        .collect();
    for name in strays.iter().map(|(n, _)| *n).chain(["0.0.0.0-0&fd00:0:0:9::-64"]) {
        assert!(ignored.iter().any(|k| k == name), "{name} not listed as ignored: {v}");
    }
    let leases: Vec<&str> =
        v["leases"].as_array().unwrap().iter().filter_map(|l| l["subnet"].as_str()).collect();
    for s in ["10.244.1.0/24", "10.244.2.0/24", "10.244.3.0/24"] {
        assert!(leases.contains(&s), "{s} missing from {v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_of_any_size_still_let_hosts_join_renew_and_route() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let mut c = etcd.client().await;
    // A /8 of /24s: 65,535 leasable subnets. 100,000 keys under the prefix: 60,000 history
    // records of subnets that expired, 30,000 live reservations of flannel hosts, 10,000 keys
    // that are not leases, and three values of 1.4 MiB: together far over the 4 MiB a single
    // gRPC reply may carry (one unpaginated range read used to fail with "decoded message
    // length too large", and no host could join).
    let net = r#"{"Network":"10.0.0.0/8","SubnetLen":24,"Backend":{"Type":"vxlan"}}"#;
    set_network(&etcd.endpoint(), &prefix, net);
    let subnet = |i: u32| format!("10.{}.{}.0-24", (i >> 8) & 0xff, i & 0xff);
    let history = r#"{"state":"held","node":"node-gone0","public_ip":"192.0.2.200"}"#;
    put_many(
        &mut c,
        (1..=60_000u32).map(|i| (format!("{prefix}/weft/history/{}", subnet(i)), history.into())),
    )
    .await;
    put_many(
        &mut c,
        (60_001..=90_000u32)
            .map(|i| (format!("{prefix}/subnets/{}", subnet(i)), lease_json(100).into_bytes())),
    )
    .await;
    put_many(
        &mut c,
        (0..10_000u32).map(|i| (format!("{prefix}/subnets/junk-{i:05}"), b"x".to_vec())),
    )
    .await;
    for i in 0..3 {
        let big = vec![b'j'; 1_400 * 1024];
        c.put(format!("{prefix}/subnets/big-{i}"), big, None).await.unwrap();
    }

    let a = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(1)));
    let sa = a.wait_ready(Duration::from_secs(60));
    let b = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(2)));
    let sb = b.wait_ready(Duration::from_secs(60));
    assert_ne!(sa, sb);
    // Both route to every reservation and to each other (30,000 + 1).
    for node in [&a, &b] {
        let deadline = Instant::now() + Duration::from_secs(30);
        while node.metric("weft_routes") != Some(30_001.0) && Instant::now() < deadline {
            sleep(0.2);
        }
        assert_eq!(node.metric("weft_routes"), Some(30_001.0), "{}", node.log());
        assert_eq!(node.metric("weft_route_ignored_keys"), Some(10_003.0));
    }
    // And keep renewing (TTL 4 s: renewals every 2 s) with listings this size around.
    let renewed = a.metric("weft_lease_renewals_total").unwrap_or(0.0);
    sleep(5.0);
    assert!(a.metric("weft_lease_renewals_total").unwrap_or(0.0) >= renewed + 2.0, "{}", a.log());
    assert_eq!(a.get("/readyz").0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_network_that_would_swallow_the_underlay_is_refused_naming_the_overlap() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    // etcd listens on 127.0.0.1: a Network of 127.0.0.0/8 would route it into the overlay.
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("net.json");
    std::fs::write(&f, r#"{"Network":"127.0.0.0/8","SubnetLen":24}"#).unwrap();
    let (code, _, err) = weft_cli(&[
        "network",
        "set",
        f.to_str().unwrap(),
        "--etcd-endpoints",
        &etcd.endpoint(),
        "--etcd-prefix",
        &prefix,
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("127.0.0.0/8") && err.contains(&etcd.endpoint()), "{err}");
    assert!(
        etcd.client().await.get(format!("{prefix}/config"), None).await.unwrap().kvs().is_empty()
    );

    // A Network holding this host's public IP: the daemon refuses to start, naming both.
    set_network(&etcd.endpoint(), &prefix, r#"{"Network":"192.0.0.0/8","SubnetLen":24}"#);
    let mut a = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(1)));
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.running() && Instant::now() < deadline {
        sleep(0.1);
    }
    assert!(!a.running(), "weft kept running with the underlay inside its Network");
    let log = a.log();
    assert!(log.contains("192.0.0.0/8") && log.contains("public IP (192.0.2.1)"), "{log}");
    let listing = etcd
        .client()
        .await
        .get(format!("{prefix}/subnets/"), Some(GetOptions::new().with_prefix()))
        .await
        .unwrap();
    assert!(listing.kvs().is_empty(), "it leased nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restored_from_a_snapshot_loses_no_host_and_makes_no_false_clash() {
    restored_from_a_snapshot(Restore::RevisionsGoBack).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restored_with_bumped_compacted_revisions_loses_no_host_and_makes_no_false_clash() {
    restored_from_a_snapshot(Restore::BumpedAndCompacted).await;
}

/// How the backup comes back.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Restore {
    /// `etcdctl snapshot restore`: the revision goes back to the snapshot's.
    RevisionsGoBack,
    /// As etcd 3.5's `etcdutl snapshot restore --bump-revision N --mark-compacted`: revisions
    /// go on from past every revision seen before the restore, and all of them before the new
    /// one are compacted, so every watch resuming from its last revision is refused as
    /// compacted. Debian's etcd is 3.4, without those flags: the same state is made by writing
    /// past the old revision outside weft's prefix, then compacting.
    BumpedAndCompacted,
}

async fn restored_from_a_snapshot(how: Restore) {
    let mut etcd = EtcdServer::start();
    let prefix = unique_prefix();
    set_network(&etcd.endpoint(), &prefix, &network_of(20));
    let mut a = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(1)));
    let sa = a.wait_ready(READY);
    // The backup: A's lease and presence as its first process wrote them.
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("backup.db");
    etcd.snapshot(&snap);
    // A restarts (a new incarnation adopts its lease), B joins; both after the backup.
    a.kill();
    a.start();
    assert_eq!(a.wait_ready(READY), sa);
    let b = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(2)));
    let sb = b.wait_ready(READY);
    sleep(4.0);
    // Other writers move the revision far past the backup's: etcd would make a watch resuming
    // there wait for hundreds of revisions before it delivered anything.
    let mut c = etcd.client().await;
    for i in 0..500 {
        c.put(format!("{prefix}/other/{i}"), "x", None).await.unwrap();
    }
    sleep(2.5); // a renewal after them: the watchers resume past them
    let before = c.get("x", None).await.unwrap().header().unwrap().revision();

    etcd.restore(&snap);
    let mut c = etcd.client().await;
    let mut after = c.get("x", None).await.unwrap().header().unwrap().revision();
    assert!(after < before, "the restore took the revision back ({before} -> {after})");
    if how == Restore::BumpedAndCompacted {
        while after <= before + 100 {
            let put = c.put(format!("{}-bump", prefix.trim_end_matches('/')), "x", None).await;
            after = put.unwrap().header().unwrap().revision();
        }
        c.compact(after, None).await.unwrap();
    }

    // B's lease was lost by the restore: B reclaims it. A's key holds its previous process's
    // write: A adopts it, and calls nobody a clone.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let a_key = read_key(&mut c, &key_of(&prefix, &sa)).await;
        let b_key = read_key(&mut c, &key_of(&prefix, &sb)).await;
        let ok = a_key.as_ref().is_some_and(|(v, _)| v["PublicIP"] == "192.0.2.1")
            && b_key.as_ref().is_some_and(|(v, _)| v["PublicIP"] == "192.0.2.2")
            && a.get("/readyz").0 == 200
            && b.get("/readyz").0 == 200;
        if ok {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not settled after the restore:\n{}\n---\n{}",
            a.log(),
            b.log()
        );
        sleep(0.2);
    }
    assert_eq!(subnet_keys(&mut c, &prefix).await.len(), 2, "no two holders, no extra key");
    assert!(!a.log().contains("IDENTITY CLASH"), "{}", a.log());
    assert!(!b.log().contains("IDENTITY CLASH"), "{}", b.log());
    // The route watchers resume in the new timeline: every lease written since the restore is
    // routed as live (none left stale), and a host joining now is routed at once.
    let n = WeftNode::spawn(NodeOptions::new(etcd.endpoint(), &prefix, ip(3)));
    n.wait_ready(READY);
    // Within the watchers' longest retry wait (their backoff after the restore's errors
    // reaches 5 s, jittered up to 7.5 s) and a margin for a loaded machine.
    for node in [&a, &b] {
        let settled = || {
            node.metric("weft_routes") == Some(2.0) && node.metric("weft_routes_stale") == Some(0.0)
        };
        let deadline = Instant::now() + Duration::from_secs(15);
        while !settled() && Instant::now() < deadline {
            sleep(0.1);
        }
        assert!(settled(), "{}\n---\n{}", node.get("/metrics").1, node.log());
    }
}

/// `weft network set` with extra flags (TLS files, credentials).
fn set_network_with(endpoint: &str, prefix: &str, json: &str, extra: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("net.json");
    std::fs::write(&f, json).unwrap();
    let mut args = vec!["network", "set", f.to_str().unwrap(), "--etcd-endpoints", endpoint];
    args.extend(["--etcd-prefix", prefix]);
    args.extend(extra);
    let (code, out, err) = weft_cli(&args);
    assert_eq!(code, 0, "network set failed: {out}{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_ca_file_alone_is_enough_and_a_wrong_ca_is_refused() {
    // The README promises TLS with only --etcd-cafile: an etcd that asks no client certificate.
    let dir = tempfile::tempdir().unwrap();
    let files = support::etcd::TlsFiles::generate(dir.path());
    let etcd = EtcdServer::start_tls_server_only(&files);
    assert!(etcd.endpoint().starts_with("https://"));
    let prefix = unique_prefix();
    let ca = files.ca.to_str().unwrap().to_owned();
    set_network_with(&etcd.endpoint(), &prefix, &network_of(20), &["--etcd-cafile", &ca]);
    let mut o = NodeOptions::new(etcd.endpoint(), &prefix, ip(1));
    o.extra = vec!["--etcd-cafile".into(), ca.clone()];
    let a = WeftNode::spawn(o);
    a.wait_ready(READY);
    let mut o = NodeOptions::new(etcd.endpoint(), &prefix, ip(2));
    o.extra = vec!["--etcd-cafile".into(), ca];
    let b = WeftNode::spawn(o);
    b.wait_ready(READY);
    assert_eq!(a.metric("weft_routes"), Some(1.0), "the watch runs over TLS too");
    // A CA that did not sign the server's certificate: never ready, and it says why.
    let mut o = NodeOptions::new(etcd.endpoint(), &prefix, ip(3));
    o.extra = vec!["--etcd-cafile".into(), files.other_ca.to_str().unwrap().to_owned()];
    let mut c = WeftNode::spawn(o);
    sleep(3.0);
    assert_ne!(c.get("/readyz").0, 200);
    let log = c.log().to_lowercase();
    assert!(log.contains("certificate") || log.contains("tls") || !c.running(), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expiring_auth_token_is_renewed_over_a_long_run() {
    // Simple tokens that expire after 1 s unused: renewals every 2 s find them expired.
    let etcd = EtcdServer::start_with_flags(&["--auth-token", "simple", "--auth-token-ttl", "1"]);
    let mut raw = etcd.client().await;
    raw.user_add("root", "rootpw", None).await.unwrap();
    raw.user_grant_role("root", "root").await.unwrap();
    raw.auth_enable().await.unwrap();
    let prefix = unique_prefix();
    let creds = ["--etcd-username", "root", "--etcd-password", "rootpw"];
    set_network_with(&etcd.endpoint(), &prefix, &network_of(20), &creds);
    let mut o = NodeOptions::new(etcd.endpoint(), &prefix, ip(1));
    o.extra = creds.iter().map(|s| s.to_string()).collect();
    let a = WeftNode::spawn(o.clone());
    a.wait_ready(READY);
    let renewed = a.metric("weft_lease_renewals_total").unwrap_or(0.0);
    sleep(9.0); // many token lifetimes
    assert!(a.metric("weft_lease_renewals_total").unwrap_or(0.0) >= renewed + 3.0, "{}", a.log());
    assert_eq!(a.get("/readyz").0, 200, "{}", a.log());
    // A host that joins now is watched, and routed, through a fresh token.
    o.public_ip = ip(2);
    let b = WeftNode::spawn(o);
    b.wait_ready(READY);
    let deadline = Instant::now() + Duration::from_secs(5);
    while a.metric("weft_routes") != Some(1.0) && Instant::now() < deadline {
        sleep(0.1);
    }
    assert_eq!(a.metric("weft_routes"), Some(1.0), "{}", a.log());
    assert!(!a.log().contains("refused the credentials"), "{}", a.log());
}

/// `--etcd-password-file`: weft reads the etcd password from a file (one trailing newline
/// dropped), for `weft run` and the admin commands alike, so it never shows in
/// `/proc/<pid>/cmdline`, which every local user can read, as `--etcd-password` does; nor in
/// weft's log. A file others may read works, with a WARN naming the path; a wrong password
/// is refused by etcd, and weft says so, not ready, without the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_etcd_password_from_a_file_authenticates_and_shows_in_no_cmdline_or_log() {
    const PASSWORD: &str = "pw-from-a-file-5e1f0c";
    let etcd = EtcdServer::start_with_flags(&["--auth-token", "simple"]);
    let mut raw = etcd.client().await;
    raw.user_add("root", PASSWORD, None).await.unwrap();
    raw.user_grant_role("root", "root").await.unwrap();
    raw.auth_enable().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("etcd-password");
    let write = |text: &str, mode: u32| {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::write(&file, text).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    write(&format!("{PASSWORD}\n"), 0o600);
    let path = file.to_str().unwrap().to_owned();
    let creds = ["--etcd-username", "root", "--etcd-password-file", path.as_str()];
    let prefix = unique_prefix();
    set_network_with(&etcd.endpoint(), &prefix, &network_of(20), &creds);
    let mut o = NodeOptions::new(etcd.endpoint(), &prefix, ip(1));
    o.extra = creds.iter().map(|s| s.to_string()).collect();
    let a = WeftNode::spawn(o.clone());
    a.wait_ready(READY);
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", a.pid())).unwrap();
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    assert!(cmdline.contains("--etcd-password-file") && cmdline.contains(&path), "{cmdline}");
    assert!(!cmdline.contains(PASSWORD), "{cmdline}");
    assert!(!a.log().contains(PASSWORD), "{}", a.log());
    assert!(!a.log().contains("readable by"), "{}", a.log());

    // Readable by others: still used, with a WARN naming the file and its mode.
    write(PASSWORD, 0o644);
    o.public_ip = ip(2);
    let b = WeftNode::spawn(o.clone());
    b.wait_ready(READY);
    let log = b.log();
    assert!(log.contains("WARN") && log.contains(&path) && log.contains("0644"), "{log}");
    assert!(!log.contains(PASSWORD), "{log}");

    // A wrong password: etcd refuses it, weft is never ready and says why, not with what.
    write("not-the-password\n", 0o600);
    o.public_ip = ip(3);
    let c = WeftNode::spawn(o);
    sleep(3.0);
    assert_ne!(c.get("/readyz").0, 200, "{}", c.log());
    let log = c.log();
    assert!(log.contains("refused the credentials"), "{log}");
    assert!(!log.contains("not-the-password") && !log.contains(PASSWORD), "{log}");
}

/// The subnet every node of [`spawn_changing_subnet`] starts from.
const FOREIGN: &str = "10.244.1.0/24";

/// A node whose subnet changes as it starts: its subnet.env names [`FOREIGN`], which a
/// flannel host (192.0.2.9) holds, so it takes another subnet and its subnet-change hook runs
/// with `$1` = [`FOREIGN`]. `dir` holds its state dir and subnet file.
async fn spawn_changing_subnet(
    etcd: &EtcdServer,
    prefix: &str,
    dir: &std::path::Path,
    edit: impl FnOnce(&mut NodeOptions),
) -> WeftNode {
    set_network(&etcd.endpoint(), prefix, &network_of(3));
    let mut c = etcd.client().await;
    c.put(key_of(prefix, FOREIGN), lease_json(9), None).await.unwrap();
    std::fs::write(
        dir.join("subnet.env"),
        "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.1.1/24\nFLANNEL_MTU=1450\n\
         FLANNEL_IPMASQ=false\n",
    )
    .unwrap();
    let mut opts = NodeOptions::new(etcd.endpoint(), prefix, ip(1));
    opts.dir = Some(dir.to_path_buf());
    edit(&mut opts);
    WeftNode::spawn(opts)
}

/// Waits up to `secs` for `f` to hold.
fn eventually(secs: f64, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    while !f() {
        if Instant::now() > deadline {
            return false;
        }
        sleep(0.1);
    }
    true
}

/// Whether a process is gone (or a zombie waiting to be reaped).
fn process_gone(pid: &str) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hooks_see_only_their_own_variables_path_and_home_never_the_etcd_password() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("hook-env");
    let a = spawn_changing_subnet(&etcd, &prefix, dir.path(), |o| {
        o.extra = vec!["--on-subnet-change".into(), format!("env > {}", out.display())];
        // etcd here has auth off; weft then connects without the credentials.
        o.env = vec![
            ("WEFT_ETCD_USERNAME".into(), "root".into()),
            ("WEFT_ETCD_PASSWORD".into(), "hunter2-do-not-leak".into()),
            ("UNRELATED_SECRET".into(), "also-not".into()),
            ("HOME".into(), "/weft-home".into()),
        ];
    })
    .await;
    let new = a.wait_ready(READY);
    let env = read_when_written(&out).expect("the hook ran");
    assert!(!env.contains("hunter2") && !env.contains("also-not"), "{env}");
    let mut names: Vec<&str> =
        env.lines().filter_map(|l| l.split_once('=')).map(|(k, _)| k).collect();
    names.sort_unstable();
    // PWD is the shell's own.
    names.retain(|n| *n != "PWD");
    assert_eq!(
        names,
        ["HOME", "PATH", "WEFT_HOLDER", "WEFT_NEW_SUBNET", "WEFT_OLD_SUBNET", "WEFT_REASON"],
        "{env}"
    );
    for want in [
        format!("WEFT_OLD_SUBNET={FOREIGN}"),
        format!("WEFT_NEW_SUBNET={new}"),
        "WEFT_REASON=subnet-changed".into(),
        "HOME=/weft-home".into(),
    ] {
        assert!(env.lines().any(|l| l == want), "{want} missing:\n{env}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hook_past_its_timeout_is_killed_with_its_process_group_and_counted() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let dir = tempfile::tempdir().unwrap();
    let pid = dir.path().join("sleep-pid");
    let a = spawn_changing_subnet(&etcd, &prefix, dir.path(), |o| {
        o.extra = vec![
            "--hook-timeout".into(),
            "1s".into(),
            "--on-subnet-change".into(),
            format!("sleep 1000 & echo $! > {}; wait", pid.display()),
        ];
    })
    .await;
    a.wait_ready(READY);
    let pid = read_when_written(&pid).expect("the hook started");
    let pid = pid.trim();
    a.wait_log("hook timed out", Duration::from_secs(5));
    assert!(eventually(2.0, || process_gone(pid)), "the hook's sleep {pid} is still running");
    assert!(eventually(2.0, || a.metric("weft_hook_failures_total") == Some(1.0)));
    // It ran, if not well: nothing is owed.
    assert!(eventually(2.0, || !dir.path().join("state/hook-pending").exists()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hook_writing_ten_megabytes_neither_blocks_nor_floods_the_log() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let dir = tempfile::tempdir().unwrap();
    let done = dir.path().join("done");
    let a = spawn_changing_subnet(&etcd, &prefix, dir.path(), |o| {
        o.extra = vec![
            "--hook-timeout".into(),
            "20s".into(),
            "--on-subnet-change".into(),
            format!(
                "head -c 10000000 /dev/zero | tr '\\0' x; head -c 10000000 /dev/zero >&2; \
                 echo finished > {}",
                done.display()
            ),
        ];
    })
    .await;
    a.wait_ready(READY);
    assert_eq!(read_when_written(&done).as_deref(), Some("finished\n"), "the hook was blocked");
    a.wait_log("hook ran", Duration::from_secs(5));
    let log = a.log();
    assert_eq!(log.matches("hook output truncated").count(), 2, "{}", &log[..log.len().min(4000)]);
    assert!(log.len() < 1_000_000, "the log holds {} bytes", log.len());
    assert_eq!(a.metric("weft_hook_failures_total"), Some(0.0));
}

/// "Hook never completed" counts as "hook never ran": weft killed while its subnet-change hook
/// runs re-runs it on the next start, once, and a hook that completed is never run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subnet_change_hook_cut_short_by_a_crash_runs_again_on_the_next_start() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    let dir = tempfile::tempdir().unwrap();
    let (runs, pid, release) =
        (dir.path().join("runs"), dir.path().join("pid"), dir.path().join("release"));
    let mut a = spawn_changing_subnet(&etcd, &prefix, dir.path(), |o| {
        o.extra = vec![
            "--on-subnet-change".into(),
            format!(
                "echo \"$1 $2\" >> {runs}; echo $$ > {pid}; [ -e {release} ] || exec sleep 1000",
                runs = runs.display(),
                pid = pid.display(),
                release = release.display()
            ),
        ];
    })
    .await;
    let new = a.wait_ready(READY);
    let count =
        |p: &std::path::Path| std::fs::read_to_string(p).unwrap_or_default().lines().count();
    assert!(eventually(5.0, || count(&runs) == 1));
    let pending = dir.path().join("state/hook-pending");
    let journal = std::fs::read_to_string(&pending).expect("the running hook is recorded");
    assert!(
        journal.starts_with(&format!("on-subnet-change old={FOREIGN} new={new} ")),
        "{journal}"
    );
    a.kill();
    // The first run is not weft's child any more; end it.
    let first = std::fs::read_to_string(&pid).unwrap();
    let _ = std::process::Command::new("kill").arg(first.trim()).status();
    std::fs::write(&release, b"").unwrap();
    a.start();
    assert_eq!(a.wait_ready(READY), new, "same subnet: no second change");
    a.wait_log("re-running a hook", Duration::from_secs(5));
    assert!(eventually(5.0, || count(&runs) == 2), "{}", a.log());
    let text = std::fs::read_to_string(dir.path().join("runs")).unwrap();
    assert!(text.lines().all(|l| l == format!("{FOREIGN} {new}")), "{text}");
    assert!(eventually(2.0, || !pending.exists()));
    // Completed: a clean restart runs nothing.
    assert_eq!(a.stop(), Some(0));
    a.start();
    a.wait_ready(READY);
    sleep(1.0);
    assert_eq!(std::fs::read_to_string(dir.path().join("runs")).unwrap().lines().count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unwritable_subnet_env_keeps_weft_unready_naming_it_and_is_retried_until_written() {
    let etcd = EtcdServer::start();
    let prefix = unique_prefix();
    set_network(&etcd.endpoint(), &prefix, &network_of(3));
    let dir = tempfile::tempdir().unwrap();
    // A directory where subnet.env goes: renaming a file over it fails for root too (EISDIR),
    // where a read-only directory would not.
    let file = dir.path().join("subnet.env");
    std::fs::create_dir(&file).unwrap();
    let mut opts = NodeOptions::new(etcd.endpoint(), &prefix, ip(1));
    opts.dir = Some(dir.path().to_path_buf());
    let a = WeftNode::spawn(opts);
    a.wait_log("could not write subnet.env", READY);
    let (code, body) = a.get("/readyz");
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains(&file.display().to_string()) && body.contains("Is a directory"),
        "{body}"
    );
    assert!(eventually(5.0, || a.metric("weft_subnet_file_write_failures_total") >= Some(2.0)));
    std::fs::remove_dir(&file).unwrap();
    a.wait_ready(READY);
    a.wait_log("subnet.env written after all", Duration::from_secs(1));
    assert_eq!(a.get("/readyz").0, 200);
}
