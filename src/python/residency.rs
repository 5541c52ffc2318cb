//! vLLM's prefix map as a [`Residency`]: dict lookups through the CPython API, and witnesses
//! that re-check a hit with one pointer comparison.
//!
//! A lookup of key `K` (block hash + group id) in `BlockHashToBlockMap._cache` that finds a
//! single `KVCacheBlock` `B` whose `_block_hash` slot holds a bytes object `H` equal to `K` leaves
//! the witness `(B, H)`, both held by strong references. vLLM sets a block's primary hash only
//! together with inserting it into the map (`BlockPool._insert_block_hash`), and clears it only
//! together with removing it (`_remove_cached_block_hashes`; `reset_prefix_cache` replaces the
//! map and clears every block). So while `B._block_hash is H` — the very object, which our
//! reference keeps from being freed and its address reused — `K` is a key of the map: the block
//! is resident. Once the block is evicted, reused or re-pointed, its slot holds `None` or another
//! object, the witness fails, and the walk looks the block up again. A different map (another
//! pool, or the map `reset_prefix_cache` made) invalidates every witness (see `ProbeEngine`).
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyType};

use super::block_pool::member_offset;
use crate::hashing::BlockHash;
use crate::prefix::{Lookup, Residency};

/// Where `KVCacheBlock` keeps its primary hash; witnesses are only taken for this exact type.
pub(super) struct HashSlot {
    block_type: Py<PyType>,
    offset: isize,
}

impl HashSlot {
    /// The `_block_hash` slot of `block_type`, or `None` (no witnesses: every block is looked
    /// up) when it is not a plain object slot.
    pub(super) fn resolve(block_type: &Bound<'_, PyType>) -> Option<Self> {
        Some(Self {
            block_type: block_type.clone().unbind(),
            offset: member_offset(block_type, "_block_hash")?,
        })
    }

    /// The object in `block`'s hash slot (borrowed, possibly null), or null if `block` is not
    /// exactly a `KVCacheBlock`.
    ///
    /// # Safety
    /// The GIL is held and `block` is a live object.
    #[inline]
    unsafe fn hash_of(&self, block: *mut ffi::PyObject) -> *mut ffi::PyObject {
        // SAFETY: guaranteed by the caller; the type check makes the offset valid for `block`.
        unsafe {
            if ffi::Py_TYPE(block) != self.block_type.as_ptr().cast() {
                return std::ptr::null_mut();
            }
            slot_value(block, self.offset)
        }
    }
}

/// The object pointer in slot `offset` of `obj` (borrowed, possibly null).
///
/// # Safety
/// The GIL is held, `obj` is a live object and `offset` the offset of an object slot of its type.
#[inline(always)]
unsafe fn slot_value(obj: *mut ffi::PyObject, offset: isize) -> *mut ffi::PyObject {
    // SAFETY: guaranteed by the caller.
    unsafe { *((obj as *const u8).offset(offset) as *const *mut ffi::PyObject) }
}

/// A cached block and the hash object it carried when a lookup found it.
pub(crate) struct BlockWitness {
    block: Py<PyAny>,
    hash: Py<PyAny>,
}

/// One reusable bytes object for map keys: a probe looks up thousands of keys, and allocating
/// and freeing a bytes object for each cost about a fifth of a full probe.
#[derive(Default)]
pub(super) struct KeyBuf {
    key: Option<Py<PyBytes>>,
}

impl KeyBuf {
    /// A bytes object holding `hash` followed by `suffix`, borrowed until the next call.
    ///
    /// The object is rewritten in place when nothing but us references it: its bytes are
    /// replaced and its cached hash reset, so to every later reader it is a fresh object. If a
    /// reference escaped (it cannot through a dict lookup, but we do not rely on that), a new
    /// object is made instead.
    pub(super) fn key(
        &mut self,
        py: Python<'_>,
        hash: &[u8],
        suffix: &[u8; 4],
    ) -> PyResult<*mut ffi::PyObject> {
        let len = hash.len() + suffix.len();
        let reusable = self.key.as_ref().is_some_and(|k| {
            // SAFETY: `k` is a live bytes object we hold.
            unsafe { ffi::Py_REFCNT(k.as_ptr()) == 1 && ffi::Py_SIZE(k.as_ptr()) == len as isize }
        });
        if !reusable {
            let mut fresh = vec![0u8; len];
            fresh[..hash.len()].copy_from_slice(hash);
            fresh[hash.len()..].copy_from_slice(suffix);
            let key = PyBytes::new(py, &fresh).unbind();
            let ptr = key.as_ptr();
            self.key = Some(key);
            return Ok(ptr);
        }
        let ptr = self.key.as_ref().expect("checked above").as_ptr();
        // SAFETY: `ptr` is a bytes object of exactly `len` bytes that only we reference (checked
        // above, with the GIL held), so writing its buffer is invisible to anyone else. Its
        // cached hash must be reset, or dict lookups would use the previous key's.
        unsafe {
            let buf = ffi::PyBytes_AS_STRING(ptr) as *mut u8;
            std::ptr::copy_nonoverlapping(hash.as_ptr(), buf, hash.len());
            std::ptr::copy_nonoverlapping(suffix.as_ptr(), buf.add(hash.len()), suffix.len());
            #[allow(deprecated)]
            {
                (*ptr.cast::<ffi::PyBytesObject>()).ob_shash = -1;
            }
        }
        Ok(ptr)
    }
}

/// vLLM's `BlockHashToBlockMap._cache` for one walk.
pub(super) struct MapResidency<'a, 'py> {
    pub(super) map: &'a Bound<'py, PyAny>,
    pub(super) keys: &'a mut KeyBuf,
    pub(super) group_suffix: [u8; 4],
    /// `None`: no witnesses are taken or trusted.
    pub(super) slot: Option<&'a HashSlot>,
    /// The first lookup error; every lookup after it answers "miss".
    pub(super) error: Option<PyErr>,
}

impl MapResidency<'_, '_> {
    /// The witness for a hit on `key` that found `found`, if `found` is a single block that
    /// carries exactly this key as its primary hash.
    ///
    /// # Safety
    /// The GIL is held; `key` is a bytes object and `found` a live object.
    unsafe fn witness(
        &self,
        key: *mut ffi::PyObject,
        found: *mut ffi::PyObject,
    ) -> Option<BlockWitness> {
        let slot = self.slot?;
        // SAFETY: guaranteed by the caller; `hash` is checked to be a bytes object before its
        // buffer is read, and both buffers are `size` bytes long.
        unsafe {
            let hash = slot.hash_of(found);
            if hash.is_null() || ffi::PyBytes_CheckExact(hash) == 0 {
                return None;
            }
            let size = ffi::Py_SIZE(hash);
            if size != ffi::Py_SIZE(key)
                || libc::memcmp(
                    ffi::PyBytes_AS_STRING(hash).cast(),
                    ffi::PyBytes_AS_STRING(key).cast(),
                    size as usize,
                ) != 0
            {
                return None;
            }
            let py = self.map.py();
            Some(BlockWitness {
                block: Bound::from_borrowed_ptr(py, found).unbind(),
                hash: Bound::from_borrowed_ptr(py, hash).unbind(),
            })
        }
    }
}

impl Residency for MapResidency<'_, '_> {
    type Witness = BlockWitness;

    fn lookup(&mut self, hash: &BlockHash) -> Lookup<BlockWitness> {
        if self.error.is_some() {
            return Lookup::Miss;
        }
        let py = self.map.py();
        let key = match self.keys.key(py, hash.as_bytes(), &self.group_suffix) {
            Ok(key) => key,
            Err(err) => {
                self.error = Some(err);
                return Lookup::Miss;
            }
        };
        // SAFETY: we hold the GIL; `map` is a dict (checked by the caller) and `key` a live
        // bytes object. `PyDict_GetItemWithError` returns a borrowed pointer, kept only as a
        // new strong reference inside a witness.
        unsafe {
            let found = ffi::PyDict_GetItemWithError(self.map.as_ptr(), key);
            if found.is_null() {
                if !ffi::PyErr_Occurred().is_null() {
                    self.error = Some(PyErr::fetch(py));
                }
                return Lookup::Miss;
            }
            Lookup::Hit(self.witness(key, found))
        }
    }

    fn still_resident(&mut self, witnesses: &[Option<BlockWitness>]) -> usize {
        let Some(slot) = self.slot else {
            return 0;
        };
        let offset = slot.offset;
        // One load per block: its hash slot. The block's type is not checked again: it was
        // exactly `KVCacheBlock` when the witness was taken, and CPython only lets `__class__`
        // change to a type of the same layout (same size, same slots), so the offset still
        // names the same slot. Reading the type cost a second cache line for half the blocks
        // (a 96-byte object straddles two lines every other time).
        witnesses
            .iter()
            .position(|witness| match witness {
                // SAFETY: we hold the GIL (a `Bound` proves it), the witness keeps the block
                // alive, and its type has the `_block_hash` slot at `offset` (see above).
                Some(w) => unsafe { slot_value(w.block.as_ptr(), offset) != w.hash.as_ptr() },
                None => true,
            })
            .unwrap_or(witnesses.len())
    }

    /// Requests each witness's hash slot (the one cache line the re-check reads) a whole
    /// segment before it is re-checked: the block objects are scattered over the pool and
    /// usually cold after a model step, and a fixed few blocks ahead (8, before) hid too little
    /// of each load.
    fn prefetch(&self, witnesses: &[Option<BlockWitness>]) {
        let Some(slot) = self.slot else {
            return;
        };
        for w in witnesses.iter().flatten() {
            prefetch(w.block.as_ptr().cast::<i8>().wrapping_offset(slot.offset));
        }
    }
}

/// Hints the CPU to load the cache line at `at`.
#[inline(always)]
fn prefetch(at: *const i8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch is only a hint: it never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}
