//! Stop strings over streamed text (the server's `stop`, the CLI's `--stop` / `-r`).

/// Stop sequences over streamed text: text is released once no stop sequence can begin in it,
/// and a stop sequence ends the reply, itself and what follows left out.
pub struct StopFilter<'a> {
    stops: &'a [String],
    held: String,
    pub stopped: bool,
}

impl<'a> StopFilter<'a> {
    pub fn new(stops: &'a [String]) -> Self {
        Self {
            stops,
            held: String::new(),
            stopped: false,
        }
    }

    /// Add `piece`; returns the text safe to send, and whether a stop sequence was reached.
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.held.push_str(piece);
        let first = (self.stops.iter())
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first {
            self.stopped = true;
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Keep the longest tail that is a prefix of some stop sequence.
        let keep = (self.stops.iter())
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&k| s.is_char_boundary(k))
                    .map(move |k| &s[..k])
            })
            .filter(|p| self.held.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// What is held back, at the end of the reply.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}
