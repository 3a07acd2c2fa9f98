//! The CLI a llama.cpp user expects (issue 23): llama.cpp's flag names as aliases, prompts from
//! files and standard input, stop strings, `--ignore-eos`, `-ngl`, penalties, a random default
//! seed, sentences for errors, and a quiet end on a closed stdout. On SmolLM2, greedy.
mod common;
use common::*;
use std::io::{Read, Write};
use std::process::{Command, Stdio};

struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn dejavu(args: &[&str], stdin: Option<&str>) -> Out {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dejavu"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = c.stdin.take().unwrap();
    input.write_all(stdin.unwrap_or("").as_bytes()).unwrap();
    drop(input);
    let o = c.wait_with_output().unwrap();
    let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    Out {
        code: o.status.code(),
        stdout: s(&o.stdout),
        stderr: s(&o.stderr),
    }
}

fn ok(args: &[&str], stdin: Option<&str>) -> Out {
    let o = dejavu(args, stdin);
    assert_eq!(o.code, Some(0), "{args:?}: {}", o.stderr);
    assert!(!o.stderr.contains("panicked"), "{}", o.stderr);
    o
}

const PROMPT: &str = "The three primary colors are";

fn model() -> String {
    model_path(SMOLLM2).to_str().unwrap().to_string()
}

#[test]
fn llama_cpp_names_mean_the_same_as_ours() {
    let m = model();
    let ours = ok(
        &[
            "generate",
            "--model",
            &m,
            "--prompt",
            PROMPT,
            "--max-tokens",
            "12",
            "--temperature",
            "0",
            "--seed",
            "3",
            "--ctx",
            "256",
            "--threads",
            "1",
        ],
        None,
    );
    let theirs = ok(
        &[
            "generate", "-m", &m, "-p", PROMPT, "-n", "12", "--temp", "0", "-s", "3", "-c", "256",
            "-t", "1",
        ],
        None,
    );
    assert_eq!(ours.stdout, theirs.stdout);
    let long = ok(
        &[
            "generate",
            "-m",
            &m,
            "-p",
            PROMPT,
            "--n-predict",
            "12",
            "--temp",
            "0",
            "--ctx-size",
            "256",
            "-t",
            "1",
        ],
        None,
    );
    assert_eq!(ours.stdout, long.stdout);
    // The prompt from a file, from standard input (`-p -`, `-f -`).
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("prompt.txt");
    std::fs::write(&f, PROMPT).unwrap();
    let base = ["generate", "-m", &m, "-n", "12", "--temp", "0", "-t", "1"];
    let from_file = ok(&[&base[..], &["-f", f.to_str().unwrap()]].concat(), None);
    let from_stdin = ok(&[&base[..], &["-p", "-"]].concat(), Some(PROMPT));
    let from_stdin_f = ok(&[&base[..], &["-f", "-"]].concat(), Some(PROMPT));
    for o in [&from_file, &from_stdin, &from_stdin_f] {
        assert_eq!(o.stdout, ours.stdout);
    }
    // `-e`: escapes in the prompt.
    let raw = ok(&[&base[..], &["-p", "Line one\nLine two"]].concat(), None);
    let escaped = ok(
        &[&base[..], &["-e", "-p", "Line one\\nLine two"]].concat(),
        None,
    );
    assert_eq!(raw.stdout, escaped.stdout);
    // `-ngl 0` is nothing; `-ngl 99` on a build without CUDA says so and runs on the CPU.
    let ngl0 = ok(&[&base[..], &["-p", PROMPT, "-ngl", "0"]].concat(), None);
    assert_eq!(ngl0.stdout, ours.stdout);
    let ngl = ok(&[&base[..], &["-p", PROMPT, "-ngl", "99"]].concat(), None);
    if !cfg!(feature = "cuda") {
        assert!(ngl.stderr.contains("no GPU backend"), "{}", ngl.stderr);
        assert_eq!(ngl.stdout, ours.stdout);
    }
    // Issue 52: `-ngl -1` (llama.cpp's every layer) is a count like 99; a word is an error
    // that names the flag.
    let all = ok(&[&base[..], &["-p", PROMPT, "-ngl", "-1"]].concat(), None);
    if !cfg!(feature = "cuda") {
        assert!(all.stderr.contains("no GPU backend"), "{}", all.stderr);
        assert_eq!(all.stdout, ours.stdout);
    }
    let bad = dejavu(&[&base[..], &["-p", PROMPT, "-ngl", "all"]].concat(), None);
    assert_eq!(bad.code, Some(2), "{}", bad.stderr);
    assert!(bad.stderr.contains("`all` for -ngl"), "{}", bad.stderr);
}

/// Issue 52: llama.cpp's multi-letter short flags are never read as a one-letter flag and its
/// value (`-cnv` was `--ctx nv`, `-sys` was `--seed ys`): ours where we have one, a hint where
/// not, a note where nothing is to be done.
#[test]
fn llama_cpp_multi_letter_flags_are_ours_or_refused() {
    let m = model();
    let cnv = dejavu(&["generate", "-m", &m, "-cnv", "-p", PROMPT], None);
    assert_eq!(cnv.code, Some(2), "{}", cnv.stderr);
    assert!(
        cnv.stderr
            .contains("`-cnv` is a llama.cpp option; conversation mode is `dejavu chat`"),
        "{}",
        cnv.stderr
    );
    let tb = dejavu(&["generate", "-m", &m, "-tb", "2", "-p", PROMPT], None);
    assert_eq!(tb.code, Some(2), "{}", tb.stderr);
    assert!(tb.stderr.contains("--threads"), "{}", tb.stderr);
    // `-sys` is chat's --system: the same reply as the long name.
    let chat = ["chat", "-m", &m, "-n", "8", "--temp", "0", "-t", "1"];
    let long = ok(
        &[&chat[..], &["--system", "Answer in French."]].concat(),
        Some("Hello\n"),
    );
    let short = ok(
        &[&chat[..], &["-sys", "Answer in French."]].concat(),
        Some("Hello\n"),
    );
    assert_eq!(short.stdout, long.stdout);
    // `-fa` (with or without a value) changes nothing and says so.
    let base = [
        "generate", "-m", &m, "-n", "6", "--temp", "0", "-t", "1", "-p", PROMPT,
    ];
    let plain = ok(&base, None);
    for fa in [&["-fa"][..], &["-fa", "on"], &["-fa=off"]] {
        let o = ok(&[&base[..], fa].concat(), None);
        assert_eq!(o.stdout, plain.stdout, "{fa:?}");
        assert!(o.stderr.contains("note: -fa"), "{fa:?}: {}", o.stderr);
    }
}

#[test]
fn stop_strings_and_ignore_eos() {
    let m = model();
    let base = ["generate", "-m", &m, "--temp", "0", "-t", "1"];
    let full = ok(&[&base[..], &["-p", PROMPT, "-n", "24"]].concat(), None);
    let words: Vec<&str> = full.stdout.split_whitespace().collect();
    assert!(words.len() > 4, "{}", full.stdout);
    let stop = words[3];
    let cut = full.stdout.find(stop).unwrap();
    for flag in ["-r", "--reverse-prompt", "--stop"] {
        let o = ok(
            &[&base[..], &["-p", PROMPT, "-n", "24", flag, stop]].concat(),
            None,
        );
        assert_eq!(
            o.stdout.trim_end(),
            full.stdout[..cut].trim_end(),
            "{flag} {stop:?}"
        );
    }
    // A chat reply ends with an end-of-turn token well before 96 tokens; --ignore-eos goes on.
    let chat = ["--chat", "-p", "Say hi.", "-n", "96"];
    let short = ok(&[&base[..], &chat[..]].concat(), None);
    let long = ok(&[&base[..], &chat[..], &["--ignore-eos"]].concat(), None);
    let decoded = |e: &str| -> usize {
        let at = e.find("decode: ").unwrap() + 8;
        e[at..].split_whitespace().next().unwrap().parse().unwrap()
    };
    assert!(decoded(&short.stderr) < 96, "{}", short.stderr);
    assert_eq!(decoded(&long.stderr), 96, "{}", long.stderr);
}

#[test]
fn seeds_penalties_and_errors() {
    let m = model();
    let base = [
        "generate", "-m", &m, "-p", PROMPT, "-n", "24", "--temp", "1.0", "-t", "1",
    ];
    // The default seed is random: two runs differ; --verbose prints it, and -s repeats the run.
    let a = ok(&[&base[..], &["--verbose"]].concat(), None);
    let b = ok(&base, None);
    assert_ne!(a.stdout, b.stdout, "two unseeded runs gave the same text");
    let seed = a
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix("seed: "))
        .expect("seed printed");
    let again = ok(&[&base[..], &["-s", seed]].concat(), None);
    assert_eq!(again.stdout, a.stdout);
    ok(
        &[
            &base[..],
            &[
                "--repeat-last-n",
                "16",
                "--presence-penalty",
                "0.5",
                "--frequency-penalty",
                "0.5",
                "--repeat-penalty",
                "1.1",
            ],
        ]
        .concat(),
        None,
    );
    for bad in [
        ["--temperature=-1", ""],
        ["--presence-penalty", "5"],
        ["--top-p", "2"],
    ] {
        let args: Vec<&str> = ["generate", "-m", &m, "-p", "hi"]
            .into_iter()
            .chain(bad)
            .filter(|s| !s.is_empty())
            .collect();
        let o = dejavu(&args, None);
        assert_eq!(o.code, Some(1), "{bad:?}: {}", o.stderr);
        assert!(
            o.stderr.starts_with("error: ") || o.stderr.contains("\nerror: "),
            "{}",
            o.stderr
        );
        assert!(
            !o.stderr.contains("SamplerConfig") && !o.stderr.contains('{'),
            "{}",
            o.stderr
        );
    }
    // quantize: `-t` is the thread count there too, the type is `--type`.
    let q = dejavu(
        &["quantize", &m, "-t", "q8_0", "-o", "/nonexistent/x.gguf"],
        None,
    );
    assert_eq!(q.code, Some(2), "{}", q.stderr);
}

/// `generate ... | head -c 5`: the reader goes away; dejavu ends quietly, exit 0.
#[test]
fn a_closed_stdout_ends_quietly() {
    let m = model();
    let mut c = Command::new(env!("CARGO_BIN_EXE_dejavu"))
        .args([
            "generate", "-m", &m, "-p", PROMPT, "-n", "48", "--temp", "0", "-t", "1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut five = [0u8; 5];
    c.stdout.take().unwrap().read_exact(&mut five).unwrap(); // then dropped: the pipe closes
    let o = c.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(!err.contains("error") && !err.contains("panicked"), "{err}");
}

/// `inspect` takes a known model name as every other command does; `generate --help` lists every
/// sparsity rule.
#[test]
fn inspect_by_name_and_the_policy_list() {
    model();
    let o = ok(&["inspect", SMOLLM2], None);
    assert!(o.stdout.contains("general.architecture"), "{}", o.stdout);
    let h = ok(&["generate", "--help"], None);
    for rule in [
        "dense",
        "recommended",
        "paper",
        "oracle:KEEP",
        "relu-exact",
        "gate-first",
        "up-first",
        "dejavu:KEEP",
        "dejavu:auto",
        "attn-norm",
        "dejavu-attn",
        "lookahead",
        "lazy-kv",
        "head:RANK:CANDIDATES",
    ] {
        assert!(h.stdout.contains(rule), "{rule} missing from --help");
    }
}
