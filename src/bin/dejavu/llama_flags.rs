//! The command line as llama.cpp's and vLLM's users type it: the spellings clap cannot parse
//! as they are meant (its short flags are one letter), rewritten to dejavu's before it parses.

/// The spellings llama.cpp and vLLM users type that clap cannot parse as they mean them (its
/// short flags are one letter): `-tp N` is `--tensor-parallel N`, and `-ngl N` (or
/// `--n-gpu-layers N`, `--gpu-layers N`) with N > 0 is `--backend cuda` (the whole model on the
/// GPU; a build without CUDA says so and stays on the CPU), with 0 nothing. Arguments need not be
/// UTF-8 (paths); clap says which one must be. llama.cpp's other multi-letter short flags
/// ([`LLAMA_FLAGS`]) become dejavu's spelling where it has one, and are refused with a hint
/// where it has none: never read as a one-letter flag and its value (`-cnv` as `-c nv`).
pub(crate) fn llama_cpp_spellings(
    args: Vec<std::ffi::OsString>,
) -> std::result::Result<Vec<std::ffi::OsString>, String> {
    let mut out = Vec::with_capacity(args.len());
    let mut it = args.into_iter().peekable();
    while let Some(a) = it.next() {
        let s = a.to_str().unwrap_or_default().to_string();
        let flag = s.split_once('=').map_or(s.as_str(), |(k, _)| k);
        if let Some((_, spelling)) = LLAMA_FLAGS.iter().find(|(f, _)| *f == flag) {
            match spelling {
                Spelling::As(long) => out.push(format!("{long}{}", &s[flag.len()..]).into()),
                Spelling::Ignored(note, values) => {
                    let takes = |v: &std::ffi::OsString| values.contains(&v.to_str().unwrap_or(""));
                    if flag == s && it.peek().is_some_and(takes) {
                        it.next();
                    }
                    eprintln!("note: {s}: {note}");
                }
                Spelling::Refused(hint) => {
                    return Err(format!("`{flag}` is a llama.cpp option; {hint}"));
                }
            }
            continue;
        }
        if let Some(v) = s
            .strip_prefix("-tp")
            .filter(|v| v.is_empty() || v.starts_with('='))
        {
            out.push(format!("--tensor-parallel{v}").into());
            continue;
        }
        let ngl = ["-ngl", "--n-gpu-layers", "--gpu-layers"];
        let value = match s.split_once('=') {
            Some((k, v)) if ngl.contains(&k) => Some(v.to_string()),
            _ if ngl.contains(&s.as_str()) => it.next().map(|v| v.to_string_lossy().into_owned()),
            _ => {
                out.push(a);
                continue;
            }
        };
        // A count of layers; llama.cpp's -1 (and any negative) is every layer.
        match value.as_deref().map(str::parse::<i64>) {
            Some(Ok(0)) => {}
            Some(Ok(_)) if cfg!(feature = "cuda") => {
                eprintln!("note: {s} runs the whole model on the GPU (--backend cuda)");
                out.extend(["--backend".into(), "cuda".into()]);
            }
            Some(Ok(_)) => eprintln!(
                "warning: {s}: this build has no GPU backend (build with --features cuda); \
                 running on the CPU"
            ),
            Some(Err(_)) => {
                let v = value.unwrap_or_default();
                return Err(format!(
                    "`{v}` for {flag}: a number of layers is expected (0: none on the GPU; \
                     any other: the whole model on the GPU, --backend cuda)"
                ));
            }
            None => return Err(format!("{flag} needs a number of layers")),
        }
    }
    Ok(out)
}

/// How dejavu takes one of llama.cpp's multi-letter short flags.
enum Spelling {
    /// The same option under dejavu's name (a value follows as it followed).
    As(&'static str),
    /// Nothing to do here (a note says why); the words that may follow as its value.
    Ignored(&'static str, &'static [&'static str]),
    /// No such option: the hint.
    Refused(&'static str),
}

/// llama.cpp's multi-letter short flags (its `common/arg.cpp`), which clap would otherwise
/// read as a one-letter flag with the rest as its value.
const LLAMA_FLAGS: &[(&str, Spelling)] = &[
    ("-sys", Spelling::As("--system")),
    ("-np", Spelling::As("--parallel")),
    ("-ctk", Spelling::As("--kv-type")),
    ("-ctv", Spelling::As("--kv-type")),
    (
        "-cnv",
        Spelling::Refused("conversation mode is `dejavu chat`"),
    ),
    (
        "-no-cnv",
        Spelling::Ignored("`dejavu generate` never converses", &[]),
    ),
    (
        "-st",
        Spelling::Refused("one turn is `dejavu generate --chat`"),
    ),
    (
        "-fa",
        Spelling::Ignored("dejavu's attention needs no switch", &["on", "off", "auto"]),
    ),
    (
        "-cb",
        Spelling::Ignored("`dejavu serve` always batches (see --parallel)", &[]),
    ),
    (
        "-nocb",
        Spelling::Refused("`dejavu serve` always batches; --parallel 1 runs one reply at a time"),
    ),
    (
        "-tb",
        Spelling::Refused("one pool runs prompts and decoding: use --threads"),
    ),
    (
        "-ub",
        Spelling::Refused("prompt batches are sized by the engine (no --ubatch-size)"),
    ),
    (
        "-sysf",
        Spelling::Refused("give the system prompt's text with --system"),
    ),
    (
        "-mli",
        Spelling::Refused("`dejavu chat` continues a line that ends with `\\`"),
    ),
    ("-co", Spelling::Refused("dejavu prints no colors")),
    ("-dkvc", Spelling::Refused("no KV cache dump; see /slots")),
    (
        "-nkvo",
        Spelling::Refused("the KV cache is on the device that runs the model"),
    ),
    (
        "-sm",
        Spelling::Refused("split a model over GPUs with --tensor-parallel N (-tp N)"),
    ),
    (
        "-ts",
        Spelling::Refused("split a model over GPUs with --tensor-parallel N (-tp N)"),
    ),
    (
        "-mg",
        Spelling::Refused("the GPU is chosen by CUDA_VISIBLE_DEVICES"),
    ),
    (
        "-ngld",
        Spelling::Refused("no draft model: see --speculate (the sparse plan drafts)"),
    ),
    (
        "-md",
        Spelling::Refused("no draft model: see --speculate (the sparse plan drafts)"),
    ),
    (
        "-hf",
        Spelling::Refused("give a GGUF path or a known model name to --model"),
    ),
    (
        "-hfr",
        Spelling::Refused("give a GGUF path or a known model name to --model"),
    ),
    (
        "-hff",
        Spelling::Refused("give a GGUF path or a known model name to --model"),
    ),
    ("-ot", Spelling::Refused("no tensor overrides")),
    (
        "-cmoe",
        Spelling::Refused("mixture-of-experts models do not load yet"),
    ),
    (
        "-ncmoe",
        Spelling::Refused("mixture-of-experts models do not load yet"),
    ),
    (
        "-dev",
        Spelling::Refused("choose the device with --backend cpu|cuda"),
    ),
    (
        "-sp",
        Spelling::Refused("special tokens are never printed as text"),
    ),
    ("-lv", Spelling::Refused("use --verbose")),
];
