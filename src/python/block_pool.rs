//! Reading vLLM's `KVCacheBlock` objects straight from their slots, through the CPython API.
//!
//! `KVCacheBlock` is a `@dataclass(slots=True)`: each field is a member descriptor at a fixed
//! offset in the object. Counting free-but-cached blocks means visiting every block (which is why
//! the usage probe only counts when asked); a Python attribute read costs ~20 ns, a slot read
//! ~1 ns. The layout is checked at run time (exact type, member descriptors of object type):
//! if vLLM ever changes the class, we fall back to ordinary attribute reads, never to guessing.
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyType};

/// Byte offsets of the `KVCacheBlock` slots the count reads.
struct SlotLayout {
    block_type: *mut ffi::PyTypeObject,
    ref_cnt: isize,
    block_hash: isize,
    block_id: isize,
}

/// Byte offset of `name` in instances of `block_type`, when it is a plain object slot (a member
/// descriptor of type `Py_T_OBJECT_EX` in the class's own namespace); `None` otherwise.
pub(super) fn member_offset(block_type: &Bound<'_, PyType>, name: &str) -> Option<isize> {
    let namespace = block_type
        .getattr(intern!(block_type.py(), "__dict__"))
        .ok()?;
    let descr = namespace.get_item(name).ok()?;
    // SAFETY: `descr` is a live object; the type check guards the cast, and CPython's member
    // descriptors always carry a valid `d_member` pointer.
    unsafe {
        let member_descr_type = &raw mut ffi::PyMemberDescr_Type;
        if ffi::PyObject_TypeCheck(descr.as_ptr(), member_descr_type) == 0 {
            return None;
        }
        let member = (*(descr.as_ptr() as *mut ffi::PyMemberDescrObject)).d_member;
        if member.is_null() || (*member).type_code != ffi::Py_T_OBJECT_EX {
            return None;
        }
        Some((*member).offset).filter(|&o| o > 0)
    }
}

impl SlotLayout {
    /// The layout of `block_type`, or `None` when a field is not a plain object slot.
    fn resolve(block_type: &Bound<'_, PyType>) -> Option<Self> {
        Some(Self {
            block_type: block_type.as_ptr() as *mut ffi::PyTypeObject,
            ref_cnt: member_offset(block_type, "ref_cnt")?,
            block_hash: member_offset(block_type, "_block_hash")?,
            block_id: member_offset(block_type, "block_id")?,
        })
    }

    /// Reads the object pointer stored in slot `offset` of `obj` (borrowed; null if unset).
    ///
    /// # Safety
    /// `obj` must be a live instance of exactly `self.block_type`.
    unsafe fn slot(&self, obj: *mut ffi::PyObject, offset: isize) -> *mut ffi::PyObject {
        // SAFETY: guaranteed by the caller; offsets come from the type's own member table.
        unsafe { *((obj as *const u8).offset(offset) as *const *mut ffi::PyObject) }
    }
}

/// Counts blocks with ref count 0 that still hold a prefix (a primary hash, or secondary hashes
/// in `cached_block_hashes_by_block`): `BlockPool.get_usage()` counts these as free.
pub(crate) fn count_cached_free(
    blocks: &Bound<'_, PyList>,
    cached_block_hashes_by_block: &Bound<'_, PyDict>,
) -> PyResult<usize> {
    let Some(first) = blocks.iter().next() else {
        return Ok(0);
    };
    match SlotLayout::resolve(&first.get_type()) {
        Some(layout) => match count_by_slots(&layout, blocks, cached_block_hashes_by_block) {
            Some(count) => Ok(count),
            None => count_by_attributes(blocks, cached_block_hashes_by_block),
        },
        None => count_by_attributes(blocks, cached_block_hashes_by_block),
    }
}

/// The fast path; `None` when some block does not match the layout (mixed types, unset slot,
/// a ref count that is not a small int), so the caller recounts the slow way.
fn count_by_slots(
    layout: &SlotLayout,
    blocks: &Bound<'_, PyList>,
    secondary: &Bound<'_, PyDict>,
) -> Option<usize> {
    let has_secondary = !secondary.is_empty();
    let mut count = 0;
    // SAFETY: we hold the GIL (the `Bound`s prove it) and the engine core is single-threaded,
    // so the list and its blocks stay alive and unchanged while we read them; every block's
    // exact type is checked before its slots are read.
    unsafe {
        let list = blocks.as_ptr();
        let none = ffi::Py_None();
        for i in 0..ffi::PyList_GET_SIZE(list) {
            let block = ffi::PyList_GET_ITEM(list, i);
            if ffi::Py_TYPE(block) != layout.block_type {
                return None;
            }
            let ref_cnt = layout.slot(block, layout.ref_cnt);
            if ref_cnt.is_null() || ffi::PyLong_CheckExact(ref_cnt) == 0 {
                return None;
            }
            let value = ffi::PyLong_AsLong(ref_cnt);
            if value == -1 && !ffi::PyErr_Occurred().is_null() {
                ffi::PyErr_Clear();
                return None;
            }
            if value != 0 {
                continue;
            }
            let hash = layout.slot(block, layout.block_hash);
            if !hash.is_null() && hash != none {
                count += 1;
            } else if has_secondary {
                let id = layout.slot(block, layout.block_id);
                if id.is_null() {
                    return None;
                }
                match ffi::PyDict_Contains(secondary.as_ptr(), id) {
                    1 => count += 1,
                    0 => {}
                    _ => {
                        ffi::PyErr_Clear();
                        return None;
                    }
                }
            }
        }
    }
    Some(count)
}

fn count_by_attributes(
    blocks: &Bound<'_, PyList>,
    secondary: &Bound<'_, PyDict>,
) -> PyResult<usize> {
    let py = blocks.py();
    let mut count = 0;
    for block in blocks.iter() {
        if block.getattr(intern!(py, "ref_cnt"))?.extract::<i64>()? != 0 {
            continue;
        }
        if !block.getattr(intern!(py, "_block_hash"))?.is_none()
            || secondary.contains(block.getattr(intern!(py, "block_id"))?)?
        {
            count += 1;
        }
    }
    Ok(count)
}
