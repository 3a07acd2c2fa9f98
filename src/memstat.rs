//! Resident memory of this process, from Linux's `/proc/self/smaps`: the whole process, and the
//! part that is pages of one mapped region (the model file). `None` where that file is missing.
//! Also the memory the system can still give (`MemAvailable`), checked before large builds, and
//! the anonymous memory in huge pages that converted weights are held in ([`huge_zeroed`]).
//!
//! `dejavu bench` reports decode memory as mapped weights + KV cache + everything else, the split
//! the CPU-speed issue sets its memory target in.

/// Resident bytes of the process and of the mappings overlapping `regions`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resident {
    pub total: u64,
    pub region: u64,
}

/// `len` zero bytes (at least one page) of anonymous memory advised to use huge pages (Linux's
/// transparent huge pages), for weights the engine converts or builds (repacked rows, the
/// sparse layouts, synthetic models): their scattered reads would wait on the TLB with 4 KiB
/// pages.
pub fn huge_zeroed(len: usize) -> std::io::Result<memmap2::MmapMut> {
    let m = memmap2::MmapMut::map_anon(len.max(1))?;
    #[cfg(target_os = "linux")]
    let _ = m.advise(memmap2::Advice::HugePage);
    Ok(m)
}

/// `MemAvailable` of /proc/meminfo in bytes (`None` where there is none).
pub fn available() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Resident memory now: the process, and the mappings overlapping `regions` (each once).
pub fn resident(regions: &[&[u8]]) -> Option<Resident> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let spans: Vec<(u64, u64)> = (regions.iter())
        .map(|r| (r.as_ptr() as u64, r.len() as u64))
        .collect();
    Some(parse_smaps(&smaps, &spans))
}

/// Sum the `Rss:` lines of every mapping, and of those overlapping any `(start, len)` span (each
/// mapping once: the kernel may merge neighbouring anonymous mappings into one).
fn parse_smaps(smaps: &str, spans: &[(u64, u64)]) -> Resident {
    let (mut total, mut in_region) = (0, 0);
    let mut overlaps = false;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        if let Some((lo, hi)) = first.split_once('-') {
            if let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) {
                overlaps = (spans.iter()).any(|&(start, len)| lo < start + len && start < hi);
                continue;
            }
        }
        if first == "Rss:" {
            let kib: u64 = words.next().and_then(|v| v.parse().ok()).unwrap_or(0);
            total += kib * 1024;
            if overlaps {
                in_region += kib * 1024;
            }
        }
    }
    Resident {
        total,
        region: in_region,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_rss_of_all_and_of_the_overlapping_mappings() {
        let smaps = "\
1000-3000 r--p 00000000 08:01 12 /models/m.gguf
Size:                  8 kB
Rss:                   4 kB
Pss:                   4 kB
5000-6000 rw-p 00000000 00:00 0
Rss:                   2 kB
ffff-10000 r-xp 00000000 08:01 13 /bin/dejavu
Rss:                   1 kB
";
        let r = parse_smaps(smaps, &[(0x1000, 0x2000)]);
        assert_eq!(
            r,
            Resident {
                total: 7 * 1024,
                region: 4 * 1024
            }
        );
        assert_eq!(parse_smaps(smaps, &[(0x4000, 0x100)]).region, 0);
        // Two spans inside one mapping count it once.
        let both = parse_smaps(smaps, &[(0x1000, 0x10), (0x2000, 0x10)]);
        assert_eq!(both.region, 4 * 1024);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_has_resident_memory() {
        let data = vec![1u8; 1 << 20];
        let r = resident(&[&data[..]]).expect("/proc/self/smaps on Linux");
        assert!(r.total >= r.region && r.region >= 1 << 20, "{r:?}");
    }
}
