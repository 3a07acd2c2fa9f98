//! Standard input and output of the command line under hostile or broken pipes (issue 52):
//! endless input is refused at a bound instead of read into memory without limit, a line
//! that is not UTF-8 is skipped rather than ending a piped chat, and a reader that goes away
//! stops the generation instead of letting it run to the end of the context.
mod common;
use common::*;
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `dejavu ARGS -m SmolLM2`.
fn dejavu(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dejavu"));
    c.args(args)
        .args(["-m", model_path(SMOLLM2).to_str().unwrap()]);
    c
}

/// `cmd` with `/dev/zero` on standard input: fails within `limit` saying `needle`.
fn refuses_endless_input(mut cmd: Command, needle: &str, limit: Duration) {
    let t0 = Instant::now();
    let out = cmd
        .stdin(std::fs::File::open("/dev/zero").unwrap())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains(needle), "{err}");
    assert!(t0.elapsed() < limit, "took {:?}", t0.elapsed());
}

#[test]
fn endless_standard_input_is_refused_at_a_bound() {
    let generate = dejavu(&["generate", "-p", "-", "-n", "2"]);
    let long = Duration::from_secs(60);
    refuses_endless_input(generate, "longer than 268435456 bytes", long);
    let chat = dejavu(&["chat", "-n", "2"]);
    refuses_endless_input(chat, "longer than 16777216 bytes", long);
}

#[test]
fn a_line_that_is_not_utf8_does_not_end_a_piped_chat() {
    let mut child = dejavu(&["chat", "-n", "3", "--temperature", "0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    let mut input = child.stdin.take().unwrap();
    input.write_all(b"hi \xff\xfe there\nSay yes.\n").unwrap();
    drop(input);
    let out = child.wait_with_output().unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{se}");
    assert!(se.contains("not UTF-8; skipped"), "{se}");
    assert!(!so.trim().is_empty(), "the next line got a reply: {se}");
}

/// A reader that takes one byte and goes: the process ends in a fraction of the time the
/// replies take (2000 tokens of `generate`, or fifty turns of `chat`: SmolLM2 on 2 threads,
/// tens of seconds).
#[test]
fn a_closed_standard_output_stops_the_generation() {
    for args in [
        &[
            "generate",
            "-p",
            "Tell me a long story.",
            "-n",
            "2000",
            "--ignore-eos",
        ][..],
        &["chat", "-n", "2000"][..],
    ] {
        let mut child = dejavu(args)
            .args(["--ctx", "2048", "-t", "2"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        {
            use std::io::Write;
            let mut input = child.stdin.take().unwrap();
            // Chat: fifty turns to answer (minutes of replies for a chat that went on).
            input
                .write_all(&b"Tell me a long story.\n".repeat(50))
                .unwrap();
        }
        let mut out = child.stdout.take().unwrap();
        let mut one = [0u8; 1];
        out.read_exact(&mut one).unwrap();
        let t0 = Instant::now();
        drop(out);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if t0.elapsed() > Duration::from_secs(5) {
                let _ = child.kill();
                panic!("{args:?}: still generating 5 s after its reader went away");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(status.success(), "{args:?}: {status}");
    }
}
