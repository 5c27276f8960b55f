#!/usr/bin/env python3
"""Where an idle round trip goes, step by step, from a scheduler and syscall trace.

    idle_trace.py TRACE TIDS [--json OUT]

TRACE is the output of scripts/lib/idle_trace.bt (bpftrace) while `ping -i 0.05` ran from h1 to
h2 over a user-space data plane (weft or flanneld's udp proxy); TIDS names the threads, one a
line: `<tid> h1|h2|ping`, the forwarding threads of each host and the ping process. For every
ping the trace is cut into the steps below, and the median of each step over all pings is
printed (µs), with how often the woken thread's CPU was idle (asleep in the hypervisor: its
wake-up waits for the vCPU to be scheduled again) and the forwarding threads' syscalls and
wake-ups per round trip.

Steps, in order (h1 sends the request, h2 answers; "fwd" is the forwarding thread that moves
the packet; a step whose thread was not asleep has no wake-up and reads 0):
  h1 tx   ping's sendto -> h1 fwd woken -> on a CPU -> its wait returns -> its send call
  wire    h1's send -> h2 fwd woken (the underlay: veth, bridge, UDP receive)
  h2      woken -> on a CPU -> wait returns -> TUN write (the echo reply is made inside it) ->
          the reply's send call
  wire    h2's send -> h1 fwd woken
  h1 rx   woken -> on a CPU -> wait returns -> TUN write
  ping    h1's TUN write -> ping woken -> on a CPU -> its recvmsg returns
"""
import json
import statistics
import sys

READS = {0, 19}  # read, readv
WRITES = {1, 20}  # write, writev
SENDS = {44, 46, 307}  # sendto, sendmsg, sendmmsg
WAITS = {7, 232, 271, 281, 441}  # poll, epoll_wait, ppoll, epoll_pwait, epoll_pwait2
SENDTO, RECVMSG = 44, 47
IDLE_EXIT = 4294967295


def load(path):
    ev = []
    for line in open(path, errors="replace"):
        f = line.split()
        if len(f) < 3 or not f[0].isdigit():
            continue
        ev.append(f)
    ev.sort(key=lambda f: int(f[0]))
    return ev


def main():
    trace, tids_path = sys.argv[1], sys.argv[2]
    out = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--json" else None
    host = {}
    for line in open(tids_path):
        f = line.split()
        if len(f) == 2:
            host[int(f[0])] = f[1]
    fwd = {t for t, h in host.items() if h in ("h1", "h2")}
    pings = {t for t, h in host.items() if h == "ping"}
    ev = load(trace)
    # Per event: (t, kind, cpu, ...) with ints where they are numbers.
    rows = []
    for f in ev:
        t, k, cpu = int(f[0]), f[1], int(f[2])
        if k == "W":
            rows.append((t, "W", cpu, int(f[3]), int(f[4])))  # target tid, target cpu
        elif k == "S":
            rows.append((t, "S", cpu, int(f[3]), int(f[4])))  # prev, next
        elif k in ("E", "X"):
            rows.append((t, k, cpu, int(f[3]), int(f[4])))  # tid, syscall
        elif k == "I":
            rows.append((t, "I", cpu, int(f[3]), 0))
    starts = [i for i, r in enumerate(rows) if r[1] == "E" and r[3] in pings and r[4] == SENDTO]
    steps = {}
    idle_wakes = {"h1 tx": [], "h2": [], "h1 rx": [], "ping": []}
    per_ping = {"fwd syscalls": [], "fwd wake-ups": [], "total": []}
    complete = 0

    def add(name, v):
        steps.setdefault(name, []).append(v / 1000)

    for n, si in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(rows)
        win = rows[si:end]
        t0 = win[0][0]
        idle = {}  # cpu -> idle now (from the last cpu_idle event seen)
        for r in rows[max(0, si - 2000):si]:
            if r[1] == "I":
                idle[r[2]] = r[3] != IDLE_EXIT

        def find(pred, frm):
            for j in range(frm, len(win)):
                if pred(win[j]):
                    return j
            return None

        # Idle state of every CPU at each event, for the wake-ups.
        idle_at = []
        for r in win:
            if r[1] == "I":
                idle[r[2]] = r[3] != IDLE_EXIT
            idle_at.append(dict(idle))

        def hop(label, h, frm, first_call):
            """A forwarding thread of host h moves the packet: woken (maybe), on a CPU, its wait
            returns, then its first call in first_call. Returns (index of that call, tid)."""
            w = find(lambda r: r[1] == "W" and r[3] in fwd and host.get(r[3]) == h, frm)
            c = find(lambda r: r[1] == "E" and host.get(r[3]) == h and r[4] in first_call, frm)
            if c is None:
                return None
            if w is not None and w < c:
                tid = win[w][3]
                s = find(lambda r: r[1] == "S" and r[4] == tid, w)
                x = find(lambda r: r[1] == "X" and r[3] == tid and r[4] in WAITS, w)
                if s is None or x is None or x > c:
                    return None
                add(f"{label}: woken", win[w][0] - win[frm][0])
                add(f"{label}: woken -> on a CPU", win[s][0] - win[w][0])
                add(f"{label}: on a CPU -> wait returns", win[x][0] - win[s][0])
                add(f"{label}: wait returns -> {'send' if first_call is SENDS else 'TUN write'}",
                    win[c][0] - win[x][0])
                idle_wakes[label].append(bool(idle_at[w].get(win[w][4], False)))
            else:
                add(f"{label}: woken", 0)
                add(f"{label}: woken -> on a CPU", 0)
                add(f"{label}: on a CPU -> wait returns", 0)
                add(f"{label}: wait returns -> {'send' if first_call is SENDS else 'TUN write'}",
                    win[c][0] - win[frm][0])
            return c, win[c][3]

        a = hop("h1 tx", "h1", 0, SENDS)
        if a is None:
            continue
        b = hop("h2", "h2", a[0], WRITES)
        if b is None:
            continue
        wx = find(lambda r: r[1] == "X" and r[3] == b[1] and r[4] in WRITES, b[0])
        snd = find(lambda r: r[1] == "E" and r[3] in fwd and host.get(r[3]) == "h2" and r[4] in SENDS, b[0])
        if wx is None or snd is None:
            continue
        add("h2: TUN write (the reply made inside)", win[wx][0] - win[b[0]][0])
        add("h2: TUN write returns -> send", win[snd][0] - win[wx][0])
        c = hop("h1 rx", "h1", snd, WRITES)
        if c is None:
            continue
        pw = find(lambda r: r[1] == "W" and r[3] in pings, c[0])
        px = find(lambda r: r[1] == "X" and r[3] in pings and r[4] == RECVMSG and r[0] > win[c[0]][0], c[0])
        if pw is None or px is None:
            continue
        ps = find(lambda r: r[1] == "S" and r[4] == win[pw][3], pw)
        if ps is None or ps > px:
            continue
        add("ping: h1's TUN write -> ping woken", win[pw][0] - win[c[0]][0])
        add("ping: woken -> on a CPU", win[ps][0] - win[pw][0])
        add("ping: on a CPU -> recvmsg returns", win[px][0] - win[ps][0])
        idle_wakes["ping"].append(bool(idle_at[pw].get(win[pw][4], False)))
        per_ping["total"].append((win[px][0] - t0) / 1000)
        per_ping["fwd syscalls"].append(sum(1 for r in win[:px] if r[1] == "E" and r[3] in fwd))
        per_ping["fwd wake-ups"].append(sum(1 for r in win if r[1] == "W" and r[3] in fwd))
        complete += 1

    print(f"{complete} of {len(starts)} round trips traced whole; medians, µs")
    result = {"round_trips": complete, "steps_us": {}, "idle_cpu_share": {}, "per_ping": {}}
    for name, vals in steps.items():
        med = statistics.median(vals)
        result["steps_us"][name] = med
        print(f"  {name:45s} {med:8.1f}")
    for name, vals in per_ping.items():
        if vals:
            med = statistics.median(vals)
            result["per_ping"][name] = med
            print(f"  {name:45s} {med:8.1f}")
    for name, vals in idle_wakes.items():
        if vals:
            share = sum(vals) / len(vals)
            result["idle_cpu_share"][name] = share
            print(f"  {name + ': woken on an idle CPU':45s} {100 * share:7.0f}%")
    if out:
        json.dump(result, open(out, "w"), indent=2)


if __name__ == "__main__":
    main()
