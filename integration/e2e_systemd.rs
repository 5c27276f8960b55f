//! systemd's service protocol against a real unix datagram socket standing in for systemd's
//! (`NOTIFY_SOCKET`): `READY=1` once `/readyz` is 200, `STATUS=`, `WATCHDOG=1` at half of
//! `WATCHDOG_USEC` and none once a worker is stuck, `FDSTORE=1` of the data plane's descriptors,
//! and their adoption through `LISTEN_FDS`/`LISTEN_FDNAMES` after a `kill -9` (the descriptors
//! kept meanwhile by this test, as systemd keeps them), with the pings that crossed it beside
//! those of a `kill -9` without the store. (systemd itself runs weft's unit in
//! `e2e_container.rs`.)
//!
//! Needs root and the tools listed in `support::netns::REQUIRED_TOOLS`.

mod support;

use std::io::{IoSliceMut, Read as _};
use std::os::fd::{AsFd as _, AsRawFd as _, OwnedFd};
use std::os::unix::net::UnixDatagram;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
use support::netns::{Lab, Pod, Weft, finish_ping, spawn_ping};

const VXLAN: &str = r#"{"Network":"10.244.0.0/16","SubnetLen":24,"Backend":{"Type":"vxlan"}}"#;
const READY: Duration = Duration::from_secs(20);

/// One notification: when it came, its text, and the descriptors that rode with it.
struct Note {
    at: Instant,
    text: String,
    fds: Vec<OwnedFd>,
}

/// A unix datagram socket in the lab's dir, standing in for systemd's notify socket.
struct NotifySocket {
    path: std::path::PathBuf,
    notes: Arc<Mutex<Vec<Note>>>,
}

impl NotifySocket {
    fn bind(dir: &std::path::Path) -> Self {
        let path = dir.join("notify.sock");
        let sock = UnixDatagram::bind(&path).expect("bind the notify socket");
        let notes: Arc<Mutex<Vec<Note>>> = Arc::default();
        let sink = notes.clone();
        std::thread::spawn(move || {
            loop {
                let mut buf = vec![0u8; 4096];
                let mut space = nix::cmsg_space!([std::os::fd::RawFd; 32]);
                let mut iov = [IoSliceMut::new(&mut buf)];
                let Ok(msg) = recvmsg::<()>(
                    sock.as_raw_fd(),
                    &mut iov,
                    Some(&mut space),
                    MsgFlags::MSG_CMSG_CLOEXEC,
                ) else {
                    return;
                };
                let mut fds = Vec::new();
                if let Ok(cmsgs) = msg.cmsgs() {
                    for c in cmsgs {
                        if let ControlMessageOwned::ScmRights(raw) = c {
                            fds.extend(raw.into_iter().filter_map(|r| weft::fds::inherit(r).ok()));
                        }
                    }
                }
                let n = msg.bytes;
                let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                sink.lock().unwrap().push(Note { at: Instant::now(), text, fds });
            }
        });
        Self { path, notes }
    }

    fn env(&self, watchdog_usec: u64) -> Vec<(String, String)> {
        vec![
            ("NOTIFY_SOCKET".into(), self.path.display().to_string()),
            ("WATCHDOG_USEC".into(), watchdog_usec.to_string()),
        ]
    }

    /// How many notifications so far contain `line` (a whole line).
    fn count(&self, line: &str, since: Instant) -> usize {
        let notes = self.notes.lock().unwrap();
        notes.iter().filter(|n| n.at >= since && n.text.lines().any(|l| l == line)).count()
    }

    fn wait(&self, line: &str, since: Instant, within: Duration) -> Instant {
        let deadline = Instant::now() + within;
        loop {
            {
                let notes = self.notes.lock().unwrap();
                if let Some(n) =
                    notes.iter().find(|n| n.at >= since && n.text.lines().any(|l| l == line))
                {
                    return n.at;
                }
            }
            assert!(Instant::now() < deadline, "no {line:?} within {within:?}: {:?}", self.texts());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn texts(&self) -> Vec<String> {
        self.notes.lock().unwrap().iter().map(|n| n.text.clone()).collect()
    }

    /// The descriptors of the fd store as it stands, by name, in storing order (an
    /// `FDSTOREREMOVE` of a name drops what was stored under it): what systemd would pass back.
    fn store(&self) -> Vec<(String, OwnedFd)> {
        let mut notes = self.notes.lock().unwrap();
        let mut store: Vec<(String, OwnedFd)> = Vec::new();
        for n in notes.iter_mut() {
            let name = n.text.lines().find_map(|l| l.strip_prefix("FDNAME=")).map(str::to_owned);
            let Some(name) = name else { continue };
            if n.text.lines().any(|l| l == "FDSTOREREMOVE=1") {
                store.retain(|(k, _)| *k != name);
            } else if n.text.lines().any(|l| l == "FDSTORE=1") {
                store.extend(n.fds.drain(..).map(|fd| (name.clone(), fd)));
            }
        }
        store
    }
}

/// Host 1 (a plain weft) and host 2 (under the stand-in notify socket), a pod behind each.
fn two_hosts(lab: &Lab, env2: &[(String, String)]) -> (Weft, Weft, Vec<Pod>) {
    let mut w1 = lab.start_weft(1, &[]);
    let env: Vec<(&str, &str)> = env2.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut w2 = lab.start_weft_with_env(2, &[], &env);
    w1.wait_ready(READY);
    w2.wait_ready(READY);
    let pods = vec![lab.pod(1, &w1.subnet_file()), lab.pod(2, &w2.subnet_file())];
    for w in [&w1, &w2] {
        w.wait_metric("weft_routes", Duration::from_secs(5), |v| v >= 1.0);
    }
    (w1, w2, pods)
}

/// Pings from `pods[0]` to `pods[1]` every 10 ms while `during` runs; (lost, sent).
fn pings_across(pods: &[Pod], during: impl FnOnce()) -> (u32, u32) {
    let mut ping = spawn_ping(&pods[0].ns, pods[1].ip, 100_000, 0.01);
    // Read as it comes: a full pipe would stall the ping.
    let mut out = ping.stdout.take().expect("ping's stdout");
    let text = std::thread::spawn(move || {
        let mut t = String::new();
        let _ = out.read_to_string(&mut t);
        t
    });
    std::thread::sleep(Duration::from_millis(300));
    during();
    std::thread::sleep(Duration::from_millis(500));
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(ping.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    );
    let tail = finish_ping(ping);
    let r = support::netns::PingResult::parse(text.join().unwrap() + &tail.text);
    (r.transmitted.saturating_sub(r.received), r.transmitted)
}

#[test]
fn notify_ready_status_watchdog_and_the_fd_store_kept_across_a_kill() {
    let lab = Lab::new(VXLAN);
    let notify = NotifySocket::bind(lab.dir());
    let t0 = Instant::now();
    let (_w1, mut w2, pods) = two_hosts(&lab, &notify.env(1_000_000));
    let subnet = w2.subnet().expect("host 2's subnet");

    // READY=1 once /readyz says ready, and the status says what weft holds.
    notify.wait("READY=1", t0, READY);
    assert_eq!(w2.get("/readyz").0, 200);
    let status = format!("STATUS=holding {subnet}, forwarding");
    notify.wait(&status, t0, Duration::from_secs(5));

    // WATCHDOG=1 at half of WATCHDOG_USEC (1 s): about six in three seconds.
    let from = Instant::now();
    std::thread::sleep(Duration::from_secs(3));
    let pings = notify.count("WATCHDOG=1", from);
    assert!((4..=8).contains(&pings), "{pings} watchdog pings in 3 s at a 0.5 s cadence");

    // The fd store holds the data plane: a layout and its descriptors.
    let store = notify.store();
    let names: Vec<&str> = store.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.contains(&"weft-dp-layout"), "{names:?}");
    let queues_and_sockets =
        names.iter().filter(|n| n.starts_with("weft-dp-") && **n != "weft-dp-layout").count();
    assert!(queues_and_sockets >= 2, "{names:?}");

    // kill -9, then a start given the store back through LISTEN_FDS (this test held the
    // descriptors meanwhile, as systemd does): the TUN device never went away.
    let (lost_kept, sent_kept) = pings_across(&pods, || {
        w2.kill();
        start_with_fds(&mut w2, store);
        w2.wait_ready(READY);
    });
    assert!(
        w2.log().contains("taking the data plane from systemd's fd store"),
        "{}",
        w2.log_tail(40)
    );
    assert_eq!(w2.subnet().as_deref(), Some(subnet.as_str()));

    // The same without the store: the TUN device goes with the process.
    drop(notify.store());
    w2.wrapper.clear();
    let (lost_plain, sent_plain) = pings_across(&pods, || {
        w2.kill();
        w2.start();
        w2.wait_ready(READY);
    });
    eprintln!(
        "kill -9 and restart: {lost_kept}/{sent_kept} pings lost with the fd store, \
         {lost_plain}/{sent_plain} without"
    );
    assert!(
        lost_kept < lost_plain,
        "the fd store kept nothing: {lost_kept}/{sent_kept} lost with it, {lost_plain}/{sent_plain} without"
    );
    // What may go: the pings still in flight when ping is stopped, a few more when the two
    // cores are busy and the new process takes longer to start (3 seen at a load of 7, 6 with
    // a compile and iperf3 beside it on a fresh root). Without the fd store a restart loses a
    // hundred or more.
    assert!(
        lost_kept <= 10,
        "{lost_kept}/{sent_kept} pings lost across a restart with the fd store"
    );

    // STOPPING=1 at a clean stop.
    let before_stop = Instant::now();
    assert_eq!(w2.stop(), Some(0));
    assert!(notify.count("STOPPING=1", before_stop) >= 1, "{:?}", notify.texts());
}

/// Starts `w` with `store`'s descriptors at 3, 4, … and `LISTEN_PID`, `LISTEN_FDS` and
/// `LISTEN_FDNAMES` set, as systemd passes its fd store to a service it starts.
fn start_with_fds(w: &mut Weft, store: Vec<(String, OwnedFd)>) {
    let n = store.len();
    let mut script = String::new();
    // Up out of the way first, then down to 3.. (the numbers may overlap).
    for (i, (_, fd)) in store.iter().enumerate() {
        weft::fds::set_cloexec(fd.as_fd(), false).unwrap();
        script.push_str(&format!("exec {}<&{} {}<&-; ", 300 + i, fd.as_raw_fd(), fd.as_raw_fd()));
    }
    for i in 0..n {
        script.push_str(&format!("exec {}<&{} {}<&-; ", 3 + i, 300 + i, 300 + i));
    }
    let names: Vec<&str> = store.iter().map(|(k, _)| k.as_str()).collect();
    script.push_str(&format!(
        "export LISTEN_PID=$$ LISTEN_FDS={n} LISTEN_FDNAMES={}; exec \"$@\"",
        names.join(":")
    ));
    w.wrapper = vec!["bash".into(), "-c".into(), script, "bash".into()];
    w.start();
    // The child has them now; this process's copies close here (systemd would keep its own).
    drop(store);
}

#[test]
fn a_stuck_worker_stops_the_watchdog_pings() {
    let lab = Lab::new(VXLAN);
    let notify = NotifySocket::bind(lab.dir());
    let mut env = notify.env(1_000_000);
    env.push(("WEFT_FAULT_HANG_THREAD".into(), "weft-q".into()));
    let (_w1, w2, pods) = two_hosts(&lab, &env);
    let t0 = Instant::now();
    notify.wait("WATCHDOG=1", t0 - Duration::from_secs(60), READY);
    // Traffic turns the workers' loops: one stops after its fiftieth turn.
    let _ = pings_across(&pods, || w2.wait_log("injected hang", Duration::from_secs(10)));
    w2.wait_log("made no progress", Duration::from_secs(5));
    let from = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(notify.count("WATCHDOG=1", from), 0, "watchdog pings went on with a stuck worker");
}
