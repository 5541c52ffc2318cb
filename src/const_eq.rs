//! Byte-string equality for `const` code: `==` on slices is not `const` at the crate's MSRV.
//! Used where a name must be found at compile time (the knob table, the ABI check).

/// Whether `a` and `b` hold the same bytes.
pub(crate) const fn bytes_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}
