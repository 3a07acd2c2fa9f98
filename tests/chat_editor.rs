//! `dejavu chat` on a terminal (issue 23): driven through tmux as a user types. History (Up),
//! editing (Left), `\` continuation, Ctrl-C stopping a reply without ending the session, /clear
//! and /exit. Skips, saying so, where tmux is not installed.
mod common;
use common::*;
use std::process::Command;
use std::time::{Duration, Instant};

struct Tmux(String);

impl Tmux {
    fn start(cmd: &str) -> Option<Self> {
        let name = format!("dejavu-chat-{}", std::process::id());
        let ok = Command::new("tmux")
            .args([
                "new-session",
                "-d",
                "-s",
                &name,
                "-x",
                "160",
                "-y",
                "50",
                cmd,
            ])
            .status()
            .ok()?
            .success();
        ok.then_some(Self(name))
    }
    fn keys(&self, keys: &[&str]) {
        let st = Command::new("tmux")
            .args(["send-keys", "-t", &self.0])
            .args(keys)
            .status()
            .unwrap();
        assert!(st.success());
    }
    fn screen(&self) -> String {
        let o = Command::new("tmux")
            .args(["capture-pane", "-p", "-J", "-S", "-200", "-t", &self.0])
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
    /// Wait (60 s at most) until `ok(screen)`.
    fn until(&self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let t0 = Instant::now();
        loop {
            let s = self.screen();
            if ok(&s) {
                return s;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "waiting for {what}; screen:\n{s}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    fn alive(&self) -> bool {
        Command::new("tmux")
            .args(["has-session", "-t", &self.0])
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.0])
            .status();
    }
}

/// The last line of the screen that is not empty.
fn last_line(s: &str) -> String {
    s.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .to_string()
}

#[test]
fn the_chat_line_editor() {
    if Command::new("tmux").arg("-V").output().is_err() {
        eprintln!("skipped: tmux is not installed");
        return;
    }
    let model = model_path(SMOLLM2);
    let cmd = format!(
        "'{}' chat -m '{}' -n 400 --temp 0 -t 1; echo EXITED $?; sleep 30",
        env!("CARGO_BIN_EXE_dejavu"),
        model.display()
    );
    let t = Tmux::start(&cmd).expect("tmux session");
    t.until("the greeting", |s| s.contains("Ctrl-C stops a reply"));
    // Editing: type "Helo", Left, "l" -> "Hello"; a turn, then its reply and a new prompt.
    t.keys(&["Helo", "Left", "l", "Enter"]);
    let s = t.until("a reply and a new prompt", |s| {
        s.contains("> Hello") && last_line(s).trim() == ">"
    });
    let after_first = s.len();
    // History: Up brings the last turn back.
    t.keys(&["Up"]);
    t.until("the last turn from history", |s| {
        last_line(s).trim() == "> Hello"
    });
    t.keys(&["C-u"]);
    // Continuation: a line ending in `\` asks for more.
    t.keys(&["Count from 1 to 400, one number per line,\\", "Enter"]);
    t.until("the continuation prompt", |s| last_line(s).trim() == ".");
    // Ctrl-C mid-reply stops the reply, keeps the session: sent as soon as the reply shows (a
    // fixed wait raced the reply's end whenever the greedy reply came out short).
    t.keys(&["and do not stop.", "Enter"]);
    t.until("the reply's start", |s| {
        s.split_once(". and do not stop.")
            .is_some_and(|(_, after)| after.lines().skip(1).any(|l| !l.trim().is_empty()))
    });
    t.keys(&["C-c"]);
    t.until("the reply stopped", |s| {
        s.contains("(reply stopped)") && last_line(s).trim() == ">"
    });
    assert!(t.alive());
    t.keys(&["/clear", "Enter"]);
    t.until("cleared", |s| s.contains("(conversation cleared)"));
    // An empty line is not the end any more.
    t.keys(&["Enter"]);
    std::thread::sleep(Duration::from_millis(300));
    assert!(!t.screen().contains("EXITED"));
    t.keys(&["/exit", "Enter"]);
    let s = t.until("the exit", |s| s.contains("EXITED"));
    assert!(s.contains("EXITED 0"), "{s}");
    assert!(s.len() > after_first);
}
