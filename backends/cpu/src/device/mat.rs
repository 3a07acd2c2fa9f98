//! The CPU device's matrices: a weight's bytes read in place from the mapped file or buffer
//! that holds them (`Device::share_mat`), or a copy.
use crate::dequant;
use crate::kernels::{axpy_blocks, repack};
use dejavu_backend_api::{BackendError, QuantType, RowLayout, SharedBytes, Weight};

/// A matrix in host memory, in the file's layout or the CPU's repacked one: the bytes of the
/// mapped file or buffer that holds it, read in place (`Device::share_mat`), or a copy.
pub struct CpuMat {
    pub(super) qtype: QuantType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) layout: RowLayout,
    data: MatBytes,
}

pub(super) enum MatBytes {
    Owned(Vec<u8>),
    /// `range` of the owner's bytes.
    Shared(SharedBytes, std::ops::Range<usize>),
}

impl CpuMat {
    fn bytes(&self) -> &[u8] {
        match &self.data {
            MatBytes::Owned(v) => v,
            MatBytes::Shared(o, r) => &(**o).as_ref()[r.clone()],
        }
    }
    pub(super) fn row(&self, r: usize, out: &mut [f32]) {
        let rb = self.qtype.row_bytes(self.cols);
        let row = &self.bytes()[r * rb..(r + 1) * rb];
        match self.layout {
            RowLayout::Ggml => dequant::dequantize_row(self.qtype, row, out),
            RowLayout::Repacked => {
                let mut ggml = vec![0u8; rb];
                repack::unpack_row(self.qtype, row, &mut ggml);
                dequant::dequantize_row(self.qtype, &ggml, out)
            }
            RowLayout::InputBlocks => {
                let b = axpy_blocks::block(self.qtype, self.bytes(), self.cols, r / 32);
                axpy_blocks::input_row(self.qtype, b, self.cols, r % 32, out)
            }
        }
    }
    pub(super) fn weight(&self) -> Result<Weight<'_>, BackendError> {
        let w = Weight::new(self.qtype, self.rows, self.cols, self.bytes())?;
        Ok(w.with_layout(self.layout))
    }
    pub(super) fn of(w: &Weight, data: MatBytes) -> Self {
        Self {
            qtype: w.qtype,
            rows: w.rows,
            cols: w.cols,
            layout: w.layout,
            data,
        }
    }
    /// Whether the matrix reads its owner's bytes in place (no copy).
    pub fn is_shared(&self) -> bool {
        matches!(self.data, MatBytes::Shared(..))
    }
}

/// Where `part` lies inside `whole`, if it does (by address: `part` borrowed from `whole`).
pub(super) fn range_in(whole: &[u8], part: &[u8]) -> Option<std::ops::Range<usize>> {
    let (w, p) = (whole.as_ptr() as usize, part.as_ptr() as usize);
    let start = p.checked_sub(w)?;
    let end = start.checked_add(part.len())?;
    (end <= whole.len()).then_some(start..end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::CpuDevice;
    use dejavu_backend_api::Device;
    use std::sync::Arc;

    #[test]
    fn a_matrix_inside_its_owner_is_read_in_place_and_any_other_is_copied() {
        let bytes: Vec<u8> = (0..4 * 34).map(|i| (i % 7) as u8).collect();
        let owner: SharedBytes = Arc::new(bytes.clone());
        let dev = CpuDevice::reference();
        // Rows 1..3 of a 4-row Q8_0 matrix of 32 columns (34 bytes a row), inside the owner.
        let part = Weight::new(QuantType::Q8_0, 2, 32, &(*owner).as_ref()[34..102]).unwrap();
        let m = dev.share_mat(&part, &owner).unwrap();
        assert!(m.is_shared());
        assert_eq!(m.bytes(), &bytes[34..102]);
        // The same bytes elsewhere: not the owner's, so copied.
        let other = bytes[34..102].to_vec();
        let w = Weight::new(QuantType::Q8_0, 2, 32, &other).unwrap();
        let m = dev.share_mat(&w, &owner).unwrap();
        assert!(!m.is_shared());
        assert_eq!(m.bytes(), &bytes[34..102]);
        assert_eq!(range_in(&bytes[..10], &bytes[5..12]), None);
        assert_eq!(range_in(&bytes[5..], &bytes[..3]), None);
        assert_eq!(range_in(&bytes, &bytes[5..12]), Some(5..12));
    }
}
