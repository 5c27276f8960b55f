#!/usr/bin/env python3
"""Invariant checker and report for scripts/chaos.sh (run by it; not meant to be run by hand).

  chaos_check.py watch  --work W --hub NS --endpoints EPS --prefix KEYPREFIX
      Records every change under KEYPREFIX with its previous value (etcdctl watch --prev-kv,
      from revision 1, resumed at the next revision whenever etcdctl exits) to W/watch.jsonl.

  chaos_check.py check  --work W --netns-prefix P --hosts N --endpoints EPS --prefix KEYPREFIX
                        --etcd-prefix PREFIX --weft BIN --label L
      One look at the cluster now: the leases as `weft lease list --json` reads them (weft's own
      key parser; the checker never reads a key as a subnet), the create revision of every key
      at the listing's revision, each host's subnet.env, the address of weft0 in each host
      namespace and each host's /readyz. Appends the result to W/checks.jsonl and prints a
      one-line summary.

  chaos_check.py report --work W --hosts N --ttl SECONDS --max-loss PCT
      Reads W/faults.jsonl, the ping logs, the readiness logs, the watch log and the checks;
      prints the per-fault table and the invariant counts; exits 1 if an invariant is broken.

  chaos_check.py --self-test
      Feeds the overlap check listings with dual-stack duplicates; exits 1 if one is missed.
"""
import argparse
import base64
import glob
import ipaddress
import json
import os
import re
import subprocess
import sys
import time


def b64(s):
    return base64.b64decode(s).decode() if s else ""


def node_of(value):
    try:
        return json.loads(value).get("WeftNodeID")
    except ValueError:
        return None


# --- watch ------------------------------------------------------------------------------------

def cmd_watch(a):
    out = open(os.path.join(a.work, "watch.jsonl"), "a", buffering=1)
    rev = 1
    while True:
        cmd = ["ip", "netns", "exec", a.hub, "etcdctl", "--endpoints", a.endpoints,
               "--dial-timeout", "2s", "watch", "--prefix", "--prev-kv", "-w", "json",
               "--rev", str(rev), a.prefix]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for line in p.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                r = json.loads(line)
            except ValueError:
                continue
            for ev in r.get("Events") or []:
                out.write(json.dumps({"t": time.time(), "ev": ev}) + "\n")
                rev = max(rev, ev["kv"].get("mod_revision", 0) + 1)
            if r.get("CompactRevision"):
                # our start revision was compacted away: a gap, go on from the present
                out.write(json.dumps({"t": time.time(), "gap": r["CompactRevision"]}) + "\n")
                rev = 0
        err = p.stderr.read()
        p.wait()
        if "compacted" in err:
            out.write(json.dumps({"t": time.time(), "gap": err.strip()}) + "\n")
            rev = 0
        time.sleep(0.5)
        if rev == 0:
            rev = current_rev(a)


def current_rev(a):
    try:
        r = subprocess.run(["ip", "netns", "exec", a.hub, "etcdctl", "--endpoints", a.endpoints,
                            "get", "x", "-w", "json"], capture_output=True, text=True, timeout=10)
        return json.loads(r.stdout)["header"]["revision"] + 1
    except Exception:
        return 1


def foreign_writes_from_watch(work):
    """PUTs that changed a key's WeftNodeID without the key being deleted first."""
    found = []
    path = os.path.join(work, "watch.jsonl")
    if not os.path.exists(path):
        return found, 0
    gaps = 0
    for line in open(path):
        rec = json.loads(line)
        if "gap" in rec:
            gaps += 1
            continue
        ev = rec["ev"]
        if ev.get("type", 0) != 0 or "prev_kv" not in ev:
            continue
        old, new = node_of(b64(ev["prev_kv"].get("value"))), node_of(b64(ev["kv"].get("value")))
        if old != new:
            found.append({"t": rec["t"], "key": b64(ev["kv"]["key"]),
                          "rev": ev["kv"].get("mod_revision"), "from": old, "to": new})
    return found, gaps


# --- check ------------------------------------------------------------------------------------

def run(cmd, timeout=5):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout
    except subprocess.TimeoutExpired:
        return ""


def readyz(ns):
    script = ("exec 3<>/dev/tcp/127.0.0.1/9797 && printf 'GET /readyz HTTP/1.0\\r\\n\\r\\n' >&3 "
              "&& cat <&3")
    body = run(["ip", "netns", "exec", ns, "timeout", "2", "bash", "-c", script], timeout=4)
    return "is ready" in body


def weft_listing(a):
    """The leases as weft itself reads them: `weft lease list --json` in the hub namespace, with
    weft's own key parser (a dual-stack key, `10.244.3.0-24&fd00::-64`, is one lease with two
    halves). None if weft could not read the store."""
    raw = run(["ip", "netns", "exec", a.netns_prefix + "hub", a.weft, "lease", "list", "--json",
               "--etcd-endpoints", a.endpoints, "--etcd-prefix", a.etcd_prefix], timeout=15)
    try:
        return json.loads(raw)
    except ValueError:
        return None


def lease_problems(listing):
    """Overlaps among the live leases of one `weft lease list --json` listing: two live leases
    must share neither an IPv4 subnet nor an IPv6 half. Returns (live leases, problems, infos)."""
    live = [l for l in listing.get("leases") or [] if l.get("live")]
    problems, infos = [], []
    nets = []
    for l in live:
        halves = []
        for field in ("subnet", "ipv6_subnet"):
            if l.get(field):
                try:
                    halves.append(ipaddress.ip_network(l[field]))
                except ValueError:
                    infos.append(f"weft listed an unreadable {field} {l[field]!r}")
        nets.append(set(halves))
    for i, x in enumerate(live):
        for j in range(i + 1, len(live)):
            shared = sorted({str(max(a, b, key=lambda n: n.prefixlen))
                             for a in nets[i] for b in nets[j] if a.overlaps(b)})
            if shared:
                problems.append(f"two live leases overlap on {' '.join(shared)}: "
                                f"{lease_label(x)} ({x.get('holder')}) and "
                                f"{lease_label(live[j])} ({live[j].get('holder')})")
    for e in listing.get("ignored") or []:
        infos.append(f"weft ignores key {e.get('key')}: {e.get('reason')}")
    for e in listing.get("skipped") or []:
        infos.append(f"weft skipped {e.get('key')}: {e.get('problem')}")
    for e in listing.get("ipv6_half_conflicts") or []:
        infos.append(f"weft: IPv6 half conflict at {e.get('key')}: {e.get('reason')}")
    return live, problems, infos


def lease_label(l):
    return l["subnet"] + (f"+{l['ipv6_subnet']}" if l.get("ipv6_subnet") and
                          l["ipv6_subnet"] != l["subnet"] else "")


def key_revisions(a, revision):
    """{etcd key: {"node", "create"}} under the subnets prefix at the listing's revision. The key
    is an opaque name here (never read as a subnet: weft's listing does that); the holder is the
    value's WeftNodeID, as in the watch log."""
    cmd = ["ip", "netns", "exec", a.netns_prefix + "hub", "etcdctl", "--endpoints", a.endpoints,
           "--command-timeout", "5s", "get", "--prefix", a.prefix, "-w", "json"]
    if revision:
        cmd += ["--rev", str(revision)]
    try:
        kvs = json.loads(run(cmd, timeout=10)).get("kvs") or []
    except ValueError:
        return None
    return {b64(kv["key"]): {"node": node_of(b64(kv.get("value"))),
                             "create": kv.get("create_revision"), "mod": kv.get("mod_revision")}
            for kv in kvs}


def cmd_check(a):
    work, P = a.work, a.netns_prefix
    problems, infos = [], []
    listing = weft_listing(a)
    etcd_ok = listing is not None
    if not etcd_ok:
        listing = {}
        infos.append("weft lease list failed (etcd unreadable)")
    live, lp, li = lease_problems(listing)
    problems += lp
    infos += li
    dup = len(lp)
    holder = {}
    for l in live:
        try:
            holder[str(ipaddress.ip_network(l["subnet"]))] = l.get("holder")
        except ValueError:
            pass  # named by lease_problems

    hosts = {}
    for n in range(1, a.hosts + 1):
        ns = f"{P}h{n}"
        h = {"n": n}
        try:
            env = open(os.path.join(work, f"h{n}", "subnet.env")).read()
            m = re.search(r"^FLANNEL_SUBNET=(\S+)", env, re.M)
            h["env"] = str(ipaddress.ip_interface(m.group(1)).network) if m else None
        except OSError:
            h["env"] = None
        h["node"] = node_id(work, n)
        tun = None
        try:
            for link in json.loads(run(["ip", "-n", ns, "-j", "addr", "show", "dev", "weft0"]) or "[]"):
                for ai in link.get("addr_info", []):
                    if ai.get("family") == "inet":
                        tun = ai["local"]
        except ValueError:
            pass
        h["tun"] = tun
        h["ready"] = readyz(ns)
        hosts[n] = h

    ready = [h for h in hosts.values() if h["ready"]]
    for i, x in enumerate(ready):
        for y in ready[i + 1:]:
            if x["env"] and x["env"] == y["env"]:
                dup += 1
                problems.append(f"h{x['n']} and h{y['n']} both ready with subnet.env {x['env']}")
            if x["tun"] and x["tun"] == y["tun"]:
                dup += 1
                problems.append(f"h{x['n']} and h{y['n']} both ready with weft0 {x['tun']}")
    node_names = {h["node"]: f"h{h['n']}" for h in hosts.values() if h["node"]}
    for h in ready:
        if not h["env"]:
            continue
        if h["tun"] and ipaddress.ip_address(h["tun"]) not in ipaddress.ip_network(h["env"]):
            infos.append(f"h{h['n']}: weft0 {h['tun']} outside subnet.env {h['env']}")
        if h["env"] in holder and holder[h["env"]] != h["node"]:
            dup += 1
            problems.append(f"h{h['n']} ready with {h['env']} but etcd gives it to "
                            f"{node_names.get(holder[h['env']], holder[h['env']])}")
        elif h["env"] not in holder and etcd_ok:
            infos.append(f"h{h['n']} ready with {h['env']} but no lease in etcd")
    for h in hosts.values():
        if not h["ready"]:
            infos.append(f"h{h['n']} not ready")
    held = {}
    for l in live:
        held.setdefault(l.get("holder"), []).append(lease_label(l))
    for node, ls in held.items():
        if len(ls) > 1:
            infos.append(f"{node_names.get(node, node)} holds {len(ls)} leases: {' '.join(sorted(ls))}")

    # A key that kept its create revision but changed holder was written by another node
    # (covers what a watch gap might have missed). Read at the listing's revision.
    foreign = []
    keys = key_revisions(a, listing.get("revision")) if etcd_ok else None
    state_path = os.path.join(work, "check-state.json")
    try:
        prev = json.load(open(state_path))
    except (OSError, ValueError):
        prev = {}
    for k, v in (keys or {}).items():
        p = prev.get(k)
        if p and p["create"] == v["create"] and p["node"] != v["node"]:
            foreign.append({"key": k, "rev": v["mod"], "from": p["node"], "to": v["node"]})
            problems.append(f"{k}: holder changed {p['node']} -> {v['node']} "
                            f"within one creation (rev {v['create']})")
    if keys is not None:
        json.dump(keys, open(state_path, "w"))
    elif etcd_ok:
        infos.append("etcdctl get failed: no create-revision check this time")

    rec = {"t": time.time(), "label": a.label, "dup": dup, "foreign": foreign,
           "problems": problems, "infos": infos, "keys": len(live),
           "hosts": {f"h{n}": {"env": h["env"], "tun": h["tun"], "ready": h["ready"]}
                     for n, h in hosts.items()}}
    with open(os.path.join(work, "checks.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
    subnets = " ".join(f"h{n}={h['env'] or '-'}{'' if h['ready'] else '(unready)'}"
                       for n, h in hosts.items())
    print(f"   check: {len(live)} leases; {subnets}; duplicates {dup}, foreign writes {len(foreign)}")
    for p in problems:
        print(f"   VIOLATION: {p}")
    for i in infos:
        print(f"   note: {i}")


def node_id(work, n):
    try:
        return open(os.path.join(work, f"h{n}", "state", "node-id")).read().strip() or None
    except OSError:
        return None


# --- report -----------------------------------------------------------------------------------

PING_RE = re.compile(r"^\[(\d+\.\d+)\] (.*)icmp_seq=(\d+)")


def parse_ping(path):
    """[(approximate send time, answered within 1 s)] for every sequence number sent."""
    seqs = {}
    for line in open(path, errors="replace"):
        m = PING_RE.match(line)
        if not m:
            continue
        t, rest, seq = float(m.group(1)), m.group(2), int(m.group(3))
        ok = "bytes from" in rest
        if "no answer yet" in rest:
            t -= 0.2
        rtt = re.search(r"time=([\d.]+) ms", line) if ok else None
        if rtt:
            t -= float(rtt.group(1)) / 1000
            # a reply later than ping's -W 1 (queued while a weft was stopped) counts as lost
            ok = float(rtt.group(1)) <= 1000
        old = seqs.get(seq)
        seqs[seq] = (min(t, old[0]) if old else t, ok or (old[1] if old else False))
    if not seqs:
        return []
    lo, hi = min(seqs), max(seqs)
    out = []
    known = sorted(seqs)
    # sequence numbers that never showed up were sent and lost; place them between neighbours
    for i in range(len(known) - 1):
        s0, s1 = known[i], known[i + 1]
        out.append((seqs[s0][0], seqs[s0][1]))
        for s in range(s0 + 1, s1):
            t = seqs[s0][0] + (seqs[s1][0] - seqs[s0][0]) * (s - s0) / (s1 - s0)
            out.append((t, False))
    out.append((seqs[hi][0], seqs[hi][1]))
    return out


def parse_ready(path):
    """[(t, ready)]"""
    res = []
    for line in open(path):
        p = line.split()
        if len(p) == 2:
            try:
                res.append((float(p[0]), p[1] == "1"))
            except ValueError:
                pass
    return res


def unready_intervals(samples, t_from, t_end):
    """Maximal runs of not-ready samples after t_from: [(start, end)]."""
    out, start = [], None
    for t, ok in samples:
        if t < t_from:
            continue
        if not ok and start is None:
            start = t
        elif ok and start is not None:
            out.append((start, t))
            start = None
    if start is not None:
        out.append((start, t_end))
    return out


def split_at(intervals, cuts):
    """Each (start, end) split at every cut strictly inside it."""
    out = []
    for s, e in intervals:
        for c in cuts:
            if s < c < e:
                out.append((s, c))
                s = c
        out.append((s, e))
    return out


EVENTS = {"exp": "lease expired locally", "rec": "recovered: the lease had vanished",
          "lost": "LEASE LOST", "chg": "this node's subnet changed", "clash": "IDENTITY CLASH"}
TS_RE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z")


def weft_events(work, hosts):
    """[(epoch, kind, host)] of the lease events in every host's weft.log."""
    from datetime import datetime, timezone
    out = []
    for n in range(1, hosts + 1):
        try:
            lines = open(os.path.join(work, f"h{n}", "weft.log"), errors="replace")
        except OSError:
            continue
        for line in lines:
            for kind, text in EVENTS.items():
                if text in line:
                    m = TS_RE.match(line)
                    if m:
                        t = datetime.fromisoformat(m.group(1)[:26]).replace(tzinfo=timezone.utc)
                        out.append((t.timestamp(), kind, n))
    return out


def holder_timelines(work):
    """node id -> [(t, holds a key)] from the watch log, in order: after each event, whether the
    node holds any key under the prefix (the holder is the value's WeftNodeID; a DELETE's comes
    from its prev_kv). Keys are opaque names here."""
    out, holder_of = {}, {}
    path = os.path.join(work, "watch.jsonl")
    if not os.path.exists(path):
        return out
    for line in open(path):
        rec = json.loads(line)
        if "ev" not in rec:
            continue
        ev = rec["ev"]
        key = b64(ev["kv"]["key"])
        touched = {holder_of.get(key)}
        if ev.get("type", 0) == 0:
            holder_of[key] = node_of(b64(ev["kv"].get("value")))
        else:
            touched.add(node_of(b64((ev.get("prev_kv") or {}).get("value"))))
            holder_of.pop(key, None)
        touched.add(holder_of.get(key))
        held = set(holder_of.values())
        for node in touched - {None}:
            out.setdefault(node, []).append((rec["t"], node in held))
    return out


def ready_without_key(samples, timeline, t0, t2):
    """Probes in [t0, t2) that answered ready although the host held no key in etcd for the
    whole second the probe could have been answered in (the watch saw it deleted before the
    probe and not re-created until after it)."""
    n = 0
    for t, ok in samples:
        if not ok or not t0 <= t < t2:
            continue
        before = [p for (tt, p) in timeline if tt <= t]
        during = [p for (tt, p) in timeline if t < tt <= t + 1.0]
        if before and not before[-1] and not any(during):
            n += 1
    return n


def cmd_report(a):
    work = a.work
    faults = [json.loads(l) for l in open(os.path.join(work, "faults.jsonl"))]
    checks = [json.loads(l) for l in open(os.path.join(work, "checks.jsonl"))]
    t_end = faults[-1]["t2"] if faults else time.time()
    t_begin = faults[0]["t0"] if faults else 0
    pings = {}
    for path in glob.glob(os.path.join(work, "ping", "*.log")):
        src, dst = os.path.basename(path)[:-4].split("-")
        pings[(int(src), int(dst))] = parse_ping(path)
    ready, samples = {}, {}
    for n in range(1, a.hosts + 1):
        p = os.path.join(work, "ready", f"h{n}.log")
        samples[n] = parse_ready(p) if os.path.exists(p) else []
        # A fault aimed at this host (stop, storm, partition) that begins while it is still
        # unready from an earlier one restarts the clock: the rest of the interval is the new
        # fault's (CI's seed 21126: a SIGSTOP began 0.3 s after the check that followed a
        # partition of the same host, and the partition was charged with both).
        aimed = sorted(f["t0"] for f in faults
                       if f.get("host") == n and f["fault"] in ("stop", "storm", "partition"))
        ready[n] = split_at(unready_intervals(samples[n], t_begin, t_end), aimed)
    timelines = holder_timelines(work)
    nodes = {n: node_id(work, n) for n in range(1, a.hosts + 1)}
    events = weft_events(work, a.hosts)
    watch_foreign, gaps = foreign_writes_from_watch(work)
    check_foreign = {(f["key"], f["rev"]) for c in checks for f in c["foreign"]}
    foreign_all = {(f["key"], f["rev"]) for f in watch_foreign} | check_foreign

    rows, bad = [], []
    for i, f in enumerate(faults):
        t0, t1, t2 = f["t0"], f["t1"], f["t2"]
        target = f.get("host")  # a weft host the fault is aimed at, or None
        exempt = target if f["fault"] in ("stop", "storm") else None
        sent = lost = bsent = blost = 0
        for (s, d), seq in pings.items():
            for t, ok in seq:
                if t0 <= t < t2:
                    sent += 1
                    lost += not ok
                    if exempt not in (s, d):
                        bsent += 1
                        blost += not ok
        mu, who = 0.0, "-"
        for n, ivs in ready.items():
            for s, e in ivs:
                if t0 <= s < t2 and e - s > mu:
                    mu, who = e - s, f"h{n}"
        bound = (t1 - t0) + 2 * a.ttl
        check = next((c for c in checks if c["label"] == f"#{i}"), None)
        dup = check["dup"] if check else 0
        fw = sum(1 for w in watch_foreign if t0 <= w["t"] < t2) + (len(check["foreign"]) if check else 0)
        bpct = 100.0 * blost / bsent if bsent else 0.0
        rwk = 0
        for n in samples:
            rwk += ready_without_key(samples[n], timelines.get(nodes[n], []), t0, t2)
        ev = {k: sum(1 for t, kind, _ in events if kind == k and t0 <= t < t2) for k in EVENTS}
        row = dict(i=i, fault=f["fault"], what=f.get("what", ""), dur=t1 - t0, sent=sent, lost=lost,
                   bpct=bpct, unready=mu, who=who, bound=bound, dup=dup, fw=fw, ev=ev, rwk=rwk)
        rows.append(row)
        if mu > bound:
            bad.append(f"#{i} {f['fault']}: {who} unready {mu:.1f}s > bound {bound:.1f}s")
        if bpct > a.max_loss:
            bad.append(f"#{i} {f['fault']}: {bpct:.1f}% of pings lost on pairs the fault should "
                       f"not affect (limit {a.max_loss}%)")

    print()
    print(f"{'#':>3} {'fault':<12} {'what':<26} {'dur s':>6} {'sent':>6} {'lost':>5} "
          f"{'bystander loss':>14} {'max unready s':>14} {'bound s':>8} {'dup':>4} {'fwrite':>6}  "
          f"{'ready w/o key':>13}  weft: expired/recovered/lost/changed")
    for r in rows:
        print(f"{r['i']:>3} {r['fault']:<12} {r['what'][:26]:<26} {r['dur']:>6.1f} {r['sent']:>6} "
              f"{r['lost']:>5} {r['bpct']:>13.1f}% {r['unready']:>9.1f} {r['who']:>4} "
              f"{r['bound']:>8.1f} {r['dup']:>4} {r['fw']:>6} {r['rwk']:>13}  "
              f"{r['ev']['exp']}/{r['ev']['rec']}/{r['ev']['lost']}/{r['ev']['chg']}")
    print()
    print("per fault type:")
    types, rwk_total = {}, [0]
    for r in rows:
        t = types.setdefault(r["fault"], [0, 0, 0, 0.0, 0, 0])
        t[0] += 1
        t[1] += r["sent"]
        t[2] += r["lost"]
        t[3] = max(t[3], r["unready"])
        t[4] += r["ev"]["exp"]
        t[5] += r["ev"]["lost"] + r["ev"]["chg"]
        rwk_total[0] += r["rwk"]
    for name, (cnt, s, l, mu, exp, chg) in types.items():
        print(f"  {name:<12} x{cnt:<3} pings {s:>6} sent {l:>5} lost ({100.0 * l / s if s else 0:.1f}%), "
              f"max unready {mu:.1f}s, leases expired locally {exp}, lost or changed {chg}")

    dups = sum(c["dup"] for c in checks)
    over = sum(1 for b in bad if "unready" in b)
    lossy = sum(1 for b in bad if "pings lost" in b)
    harness = [f for f in faults if f.get("error")]
    print()
    print(f"invariants: duplicate holders {dups}, writes to another node's key {len(foreign_all)}, "
          f"hosts unready past fault+2 TTLs {over}, faults over the {a.max_loss}% bystander loss "
          f"limit {lossy}  ({len(checks)} checks; watch restarts after compaction {gaps})")
    for c in checks:
        for p in c["problems"]:
            print(f"  VIOLATION at check {c['label']}: {p}")
    for w in watch_foreign:
        print(f"  VIOLATION: {w['key']} rewritten at rev {w['rev']} from node {w['from']} to {w['to']}")
    for b in bad:
        print(f"  VIOLATION: {b}")
    for f in harness:
        print(f"  HARNESS ERROR in #{faults.index(f)} {f['fault']}: {f['error']}")
    print(f"  /readyz probes answered ready while the host held no key in etcd: {rwk_total[0]} "
          "(reported, not an invariant: a duplicate needs a second holder)")
    clashes = sum(1 for _, kind, _ in events if kind == "clash")
    if clashes:
        print(f"  note: weft logged {clashes} identity clash(es)")
    summary = {"faults": len(faults), "duplicates": dups, "foreign_writes": len(foreign_all),
               "unready_over_bound": over, "lossy_faults": lossy, "harness_errors": len(harness),
               "ready_without_key_probes": rwk_total[0],
               "types": {k: {"count": v[0], "sent": v[1], "lost": v[2], "max_unready": v[3],
                             "expired_locally": v[4], "lost_or_changed": v[5]}
                         for k, v in types.items()}}
    with open(os.path.join(work, "summary.json"), "w") as f:
        json.dump(summary, f)
    broken = dups or foreign_all or bad or harness
    return 1 if broken else 0


# --- self-test --------------------------------------------------------------------------------

def self_test():
    """The overlap check on `weft lease list --json` listings, dual-stack included."""
    def lease(subnet, v6, holder, live=True):
        return {"subnet": subnet, "ipv6_subnet": v6, "public_ip": "192.0.2.1", "holder": holder,
                "backend": "vxlan", "ttl_seconds": 4 if live else None,
                "history": "none" if live else "expired", "live": live}

    def listing(*leases):
        return {"revision": 7, "leases": list(leases), "ignored": [], "skipped": [],
                "ipv6_half_conflicts": []}

    cases = [
        # (what, listing, overlaps expected, a string every problem names)
        ("dual-stack, distinct halves", listing(
            lease("10.244.1.0/24", "fd00:0:0:1::/64", "a"),
            lease("10.244.2.0/24", "fd00:0:0:2::/64", "b")), 0, None),
        # keys 10.244.1.0-24&fd00:0:0:1::-64 and 10.244.2.0-24&fd00:0:0:1::-64: the parser this
        # replaced (k.replace("-", "/")) filed both as unparsable and so saw no overlap
        ("dual-stack, one IPv6 half twice", listing(
            lease("10.244.1.0/24", "fd00:0:0:1::/64", "a"),
            lease("10.244.2.0/24", "fd00:0:0:1::/64", "b")), 1, "fd00:0:0:1::/64"),
        ("dual-stack, one IPv4 subnet twice", listing(
            lease("10.244.1.0/24", "fd00:0:0:1::/64", "a"),
            lease("10.244.1.0/24", "fd00:0:0:2::/64", "b")), 1, "10.244.1.0/24"),
        ("IPv6-only lease inside a dual-stack lease's half", listing(
            lease("fd00:0:0:3::/64", "fd00:0:0:3::/64", "a"),
            lease("10.244.3.0/24", "fd00:0:0:3::/64", "b")), 1, "fd00:0:0:3::/64"),
        ("IPv4-only, nested", listing(
            lease("10.244.0.0/16", None, "a"), lease("10.244.4.0/24", None, "b")), 1, "10.244"),
        ("an expired lease's half is not live", listing(
            lease("10.244.1.0/24", "fd00:0:0:1::/64", "a"),
            lease("10.244.2.0/24", "fd00:0:0:1::/64", "b", live=False)), 0, None),
    ]
    failed = 0
    for what, l, want, names in cases:
        _, problems, _ = lease_problems(l)
        ok = len(problems) == want and all(names in p for p in problems)
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {what}: {len(problems)} overlap(s) (want {want})"
              + "".join(f"\n       {p}" for p in problems))
    print("self-test:", "FAILED" if failed else "ok")
    return 1 if failed else 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    ap = argparse.ArgumentParser(epilog="or: chaos_check.py --self-test")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("watch")
    w.add_argument("--work", required=True)
    w.add_argument("--hub", required=True)
    w.add_argument("--endpoints", required=True)
    w.add_argument("--prefix", required=True)
    c = sub.add_parser("check")
    c.add_argument("--work", required=True)
    c.add_argument("--netns-prefix", required=True)
    c.add_argument("--hosts", type=int, required=True)
    c.add_argument("--endpoints", required=True)
    c.add_argument("--prefix", required=True)
    c.add_argument("--etcd-prefix", required=True)
    c.add_argument("--weft", required=True)
    c.add_argument("--label", required=True)
    r = sub.add_parser("report")
    r.add_argument("--work", required=True)
    r.add_argument("--hosts", type=int, required=True)
    r.add_argument("--ttl", type=float, required=True)
    r.add_argument("--max-loss", type=float, default=5.0)
    a = ap.parse_args()
    if a.cmd == "watch":
        cmd_watch(a)
    elif a.cmd == "check":
        cmd_check(a)
    else:
        sys.exit(cmd_report(a))


if __name__ == "__main__":
    main()
