//! The GGUF reader on a file written by an independent writer (gguf-py), and on crafted bad files:
//! each must give a clear, typed error and never panic.
mod common;
use dejavu_formats::{FormatError, GgufFile, MetaValue};

fn fixture_path() -> &'static str {
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/quants.gguf")
}

#[test]
fn reads_every_metadata_type_written_by_gguf_py() {
    let f = GgufFile::open(fixture_path()).unwrap();
    let get = |k: &str| f.get(k).unwrap_or_else(|| panic!("missing {k}")).clone();
    assert_eq!(get("fx.u8"), MetaValue::U8(200));
    assert_eq!(get("fx.i8"), MetaValue::I8(-100));
    assert_eq!(get("fx.u16"), MetaValue::U16(60000));
    assert_eq!(get("fx.i16"), MetaValue::I16(-30000));
    assert_eq!(get("fx.u32"), MetaValue::U32(4_000_000_000));
    assert_eq!(get("fx.i32"), MetaValue::I32(-2_000_000_000));
    assert_eq!(get("fx.f32"), MetaValue::F32(1.5));
    assert_eq!(get("fx.bool"), MetaValue::Bool(true));
    assert_eq!(get("fx.string"), MetaValue::String("héllo wörld".into()));
    let strs =
        |v: &[&str]| MetaValue::Array(v.iter().map(|s| MetaValue::String(s.to_string())).collect());
    assert_eq!(get("fx.strings"), strs(&["a", "bc", ""]));
    let nested = get("fx.nested");
    let nested = nested.as_array().unwrap();
    assert_eq!(nested.len(), 2);
    assert_eq!(
        nested[0]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect::<Vec<_>>(),
        vec![1, 2]
    );
    assert_eq!(
        nested[1]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect::<Vec<_>>(),
        vec![3]
    );
    assert_eq!(get("fx.u64"), MetaValue::U64((1 << 63) + 5));
    assert_eq!(get("fx.i64"), MetaValue::I64(-(1 << 62)));
    assert_eq!(get("fx.f64"), MetaValue::F64(-2.25));
    let t = f.tensor("Q6_K.q").unwrap();
    assert_eq!((t.row_len(), t.n_rows(), t.n_bytes), (512, 3, 3 * 2 * 210));
}

/// Parse crafted bytes through the file API.
fn open_bytes(bytes: &[u8]) -> Result<GgufFile, FormatError> {
    let f = common::temp_file(bytes);
    GgufFile::open(f.path())
}

#[test]
fn bad_files_give_typed_errors() {
    let good = std::fs::read(fixture_path()).unwrap();
    assert!(matches!(open_bytes(&[]), Err(FormatError::Empty { .. })));
    assert!(matches!(
        open_bytes(b"GGML\x03\0\0\0"),
        Err(FormatError::BadMagic { .. })
    ));
    let mut v1 = good.clone();
    v1[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(matches!(
        open_bytes(&v1),
        Err(FormatError::UnsupportedVersion(1))
    ));
    // A cut header fails either on the read that runs out or on a count the rest cannot hold.
    for cut in [6, 20, 200, 1000] {
        let r = open_bytes(&good[..cut]);
        assert!(
            matches!(
                r,
                Err(FormatError::Truncated { .. } | FormatError::Implausible { .. })
            ),
            "cut {cut}: {:?}",
            r.err()
        );
    }
    // Truncated tensor data: the header is intact but the last tensor ends past the file.
    assert!(matches!(
        open_bytes(&good[..good.len() - 32]),
        Err(FormatError::TensorOutOfBounds { .. })
    ));
    let mut absurd = good.clone();
    absurd[16..24].copy_from_slice(&(u64::MAX / 2).to_le_bytes()); // kv count
    assert!(matches!(
        open_bytes(&absurd),
        Err(FormatError::Implausible { .. })
    ));
    let mut long_key = good.clone();
    long_key[24..32].copy_from_slice(&(1u64 << 50).to_le_bytes()); // first key's length
    assert!(matches!(
        open_bytes(&long_key),
        Err(FormatError::Implausible { .. })
    ));
}

#[test]
fn bad_tensor_entries() {
    use dejavu_formats::gguf::{write, GgmlType};
    let data = vec![0u8; 34];
    let good = write(&[], &[("t", &[32, 1], GgmlType::Q8_0, &data)]);
    assert!(open_bytes(&good).is_ok());
    // Locate the tensor entry: name "t" then rank, dims, type id, offset.
    let at = good
        .windows(9)
        .position(|w| w == [1, 0, 0, 0, 0, 0, 0, 0, b't'])
        .unwrap()
        + 9;
    let type_at = at + 4 + 2 * 8;
    let mut unknown = good.clone();
    unknown[type_at..type_at + 4].copy_from_slice(&77u32.to_le_bytes());
    assert!(matches!(
        open_bytes(&unknown),
        Err(FormatError::UnknownGgmlType { type_id: 77, .. })
    ));
    let mut past_end = good.clone();
    past_end[type_at + 4..type_at + 12].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(
        open_bytes(&past_end),
        Err(FormatError::TensorOutOfBounds { .. })
    ));
    let mut overflow = good.clone();
    overflow[type_at + 4..type_at + 12].copy_from_slice(&(u64::MAX - 31).to_le_bytes());
    assert!(matches!(
        open_bytes(&overflow),
        Err(FormatError::TensorOutOfBounds { .. })
    ));
    let mut ragged = good.clone();
    ragged[at + 4..at + 12].copy_from_slice(&33u64.to_le_bytes());
    assert!(matches!(
        open_bytes(&ragged),
        Err(FormatError::BadShape { .. })
    ));
    let mut rank = good.clone();
    rank[at..at + 4].copy_from_slice(&9u32.to_le_bytes());
    assert!(matches!(
        open_bytes(&rank),
        Err(FormatError::BadShape { .. })
    ));
}
