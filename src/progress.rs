//! Progress bars for long work (layout conversion, calibration, perplexity): drawn on stderr
//! when it is a terminal, hidden otherwise (indicatif's own rule).
use indicatif::{ProgressBar, ProgressStyle};

/// A bar of `len` steps labelled `what`, with elapsed time and an estimate of what is left.
pub fn bar(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:40} {pos}/{len} {prefix} {elapsed} elapsed, eta {eta} {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_prefix(what.to_string());
    bar
}

/// A bar of `len` bytes labelled `what`, with throughput.
pub fn bytes_bar(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {prefix} {binary_bytes_per_sec}, eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_prefix(what.to_string());
    bar
}
