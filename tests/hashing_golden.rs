//! Golden vectors: our block hashes must equal vLLM 0.32's `hash_block_tokens` bit for bit.
//!
//! Generated with the project venv (the set-up's virtual environment, vLLM 0.32,
//! cbor2, xxhash) by this snippet; `h(parent, toks)` is exactly what vLLM's engine computes:
//!
//! ```python
//! from vllm.utils.hashing import get_hash_fn_by_name
//! from vllm.v1.core.kv_cache_utils import hash_block_tokens
//!
//! def mixed(n, seed):  # spans every int opcode width
//!     return [(i * 2654435761 + seed) % 2**32 for i in range(n)]
//!
//! def vocab(n):  # realistic ids below a 151,936-token vocabulary
//!     return [(i * 7919 + 13) % 151936 for i in range(n)]
//!
//! EDGES = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1]
//! FRAME_EDGE = [65536] * 13098 + [1] * 4  # first pickle frame ends exactly at 64 KiB
//! for name in ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]:
//!     fn = get_hash_fn_by_name(name)
//!     none = fn("vllm-none-hash")  # vLLM's NONE_HASH when the seed is the default
//!     h = lambda parent, toks: hash_block_tokens(fn, parent, toks, None) if parent else fn((none, tuple(toks), None))
//!     b16 = h(None, vocab(16))
//!     chain, parent = [], None
//!     for i in range(4):
//!         parent = h(parent, mixed(64, 99)[16 * i:16 * i + 16]); chain.append(parent)
//!     print(name, none.hex())
//!     for label, v in [("empty", h(None, [])), ("one", h(None, [7])), ("two", h(None, [7, 8])),
//!                      ("three", h(None, [7, 8, 9])), ("edges", h(None, EDGES)),
//!                      ("vocab16", b16), ("child32", h(b16, vocab(32))),
//!                      ("mixed20000", h(None, mixed(20000, 5))),
//!                      ("mixed20000_child", h(b16, mixed(20000, 5))),
//!                      ("frame_edge", h(None, FRAME_EDGE)), ("chain4", chain[-1]),
//!                      ("long20000", h(None, [2**32 - 1] * 20000))]:
//!         print("  ", label, v.hex())
//! ```
//!
//! `mixed(20000, 5)` pickles to 120,057 bytes in two frames (65,536 + 54,501), so it checks the
//! frame split; `FRAME_EDGE` puts the split right before `NONE`; `long20000` (every id a
//! 7-byte `LONG1`) needs three frames (65,542 + 65,541 + 8,959).
use session_gate::Error;
use session_gate::hashing::{BlockHash, BlockHasher, HashAlgo};

struct Golden {
    algo: HashAlgo,
    none_hash: &'static str,
    cases: [(&'static str, &'static str); 12],
}

const GOLDEN: [Golden; 4] = [
    Golden {
        algo: HashAlgo::Sha256,
        none_hash: "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
        cases: [
            (
                "empty",
                "6b385b8167a0f2e87a4d0ef604c1a1398e533330e4b2ad529494414c5810ed15",
            ),
            (
                "one",
                "ad42afba4a7360560993bf7d42e4779856653b1fa26a67489cc9776a59d18d26",
            ),
            (
                "two",
                "a8742cb38b8a9b222a17320a9081a41d836383b12af2f6be76524759faa6b2c2",
            ),
            (
                "three",
                "61c80e2a1ad74012262976559efa3795a454e4aa5aad08e22dc574b13b30197d",
            ),
            (
                "edges",
                "fdd3377b71154e8604b0e082d44cd1373b15a9a5c9b5ecfcb3ba1284dc56e78c",
            ),
            (
                "vocab16",
                "6ab141cf6df1fd210cb0636d12329df6612c127f8b145ff7475b88cb0205fcc0",
            ),
            (
                "child32",
                "cd01f7805cbbe8e85ad17357ae0b8473c11dc3238603670ca66258d53e8d3f7a",
            ),
            (
                "mixed20000",
                "094efe24ea124a691aaf2a7b95ffa84c3897756c5a34e02a5476070efd7a3458",
            ),
            (
                "mixed20000_child",
                "e75238390112ee21e35be8323c86bfd12a917c61d877e4774b802f492dc5b7d3",
            ),
            (
                "frame_edge",
                "9018c6f266d67500ab2b967f0b4e572fb098d65ae289575a0b3370e708cdf3fd",
            ),
            (
                "chain4",
                "2c7b1bdac671d953b26e0d88446300ac17727ca345982aad3ae3e305637141c9",
            ),
            (
                "long20000",
                "53e8b37966d3151fc3237f51e5c44ed7805f3b3435204ffaef2485f41d4ae751",
            ),
        ],
    },
    Golden {
        algo: HashAlgo::Sha256Cbor,
        none_hash: "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
        cases: [
            (
                "empty",
                "b85598ff86fb5e95d66e56b3165ec1d7894cfb95730a88a4cdad952dd7702c55",
            ),
            (
                "one",
                "13d3f705f79b720edaa9d07ce3cc48ffacb47dc6434ebe1d59e7ebfe51d282d6",
            ),
            (
                "two",
                "a6d2bb0a1b32701ea4fb535da971c7b5d1ed81400e535746759010d0024ed5d1",
            ),
            (
                "three",
                "e1e8f61536f9d433753d978a48fd298000c4c61a9c897078d71b10373ac6961a",
            ),
            (
                "edges",
                "7535dd7e574dc45cda2684d76483ff66ec0ea0ab7d86c85f352fc42a0d026e6b",
            ),
            (
                "vocab16",
                "11dbff107932c6a93362311bc1e0c5c53f91709d25e9cfcdb7a7689a1fc5ba5f",
            ),
            (
                "child32",
                "fa5debe4a0ae81782a038c6837c3ef78d4f734e2424cff0147e19f683e4118fe",
            ),
            (
                "mixed20000",
                "6f358b82796d3853ffbd86b8c8b6c6f958ef8dbdfbb70cb4b5f7f6e1e77468a6",
            ),
            (
                "mixed20000_child",
                "9f48f70ebabddaea01a00de1cb845e0f24b56af90e1a2cd30eeb3b861190daf9",
            ),
            (
                "frame_edge",
                "f8e8304293c4e99ef892153950a1ee79421b89049a79973147a14fbbee5fef10",
            ),
            (
                "chain4",
                "bb9ba81b59c18cc98732444657bc5e498fd157413f912d471642eb9bb9149419",
            ),
            (
                "long20000",
                "9fd0cc3a3eb33dd1ea3c709b9d2d73864516c377c6573ffec7a4d695727e3586",
            ),
        ],
    },
    Golden {
        algo: HashAlgo::Xxhash,
        none_hash: "d98f72b9c430d985211489af307f0229",
        cases: [
            ("empty", "9bb60ec5227e2fa8f011975805e37100"),
            ("one", "f1a5754f73db8fc60cd4c7b92376e837"),
            ("two", "8f9958b3d0bae2e99adc387ccdc5d151"),
            ("three", "6e0b0646b208ae5ec3d58db0969eebf8"),
            ("edges", "f52c999efe44c902f0d95ebcca055f24"),
            ("vocab16", "b81f55061bb3f9401d8a85440ac5afec"),
            ("child32", "77884fd74a8c61c3c21af87dd4f626fd"),
            ("mixed20000", "4bb7793341c8200b08d5c71c855fbd79"),
            ("mixed20000_child", "85ce8197ae5c83f39e78fa56f44615de"),
            ("frame_edge", "a8f4beae71ca318f0b91cdf65ed50379"),
            ("chain4", "5af4b8afe617a0e79afc1bd171f9030c"),
            ("long20000", "bfe107b620cb790a84eab24c5bfe9012"),
        ],
    },
    Golden {
        algo: HashAlgo::XxhashCbor,
        none_hash: "a4e364baa0791a6f63bbf917db9b700d",
        cases: [
            ("empty", "29389256b78fd91fff00825adf22e4e1"),
            ("one", "aadc90137acd142b3a5030b1ce692ada"),
            ("two", "c30cbcc2d42777d0d6b486bd3c5dc648"),
            ("three", "589a949d48f82eef9ac2a726eeee3cd8"),
            ("edges", "41ed16567db4aadc796ec3b5fa7a8d7e"),
            ("vocab16", "198baa40cd751398df23cb92701b2e8b"),
            ("child32", "e0e0bd028df3cd74fdf3978aa3aa50bd"),
            ("mixed20000", "17941c527b7723505d7d5bf1b40dea86"),
            ("mixed20000_child", "30f90c6ce3d58b5a057827b25f58fdea"),
            ("frame_edge", "02eca95951b4a4b3b307d4d2413bfe4d"),
            ("chain4", "3f2b3f61379934caf6f132d254c611e0"),
            ("long20000", "215a31719d7ad1cf6cab66d82b5e6614"),
        ],
    },
];

fn unhex(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

fn mixed(n: u32, seed: u32) -> Vec<u32> {
    (0..n)
        .map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed))
        .collect()
}

fn vocab(n: u32) -> Vec<u32> {
    (0..n).map(|i| (i * 7919 + 13) % 151_936).collect()
}

const EDGES: [u32; 9] = [
    0,
    1,
    255,
    256,
    65535,
    65536,
    (1 << 31) - 1,
    1 << 31,
    u32::MAX,
];

/// What the Python snippet computes for `label`.
fn compute(h: &mut BlockHasher, label: &str) -> BlockHash {
    let b16 = h.hash_block(None, &vocab(16));
    match label {
        "empty" => h.hash_block(None, &[]),
        "one" => h.hash_block(None, &[7]),
        "two" => h.hash_block(None, &[7, 8]),
        "three" => h.hash_block(None, &[7, 8, 9]),
        "edges" => h.hash_block(None, &EDGES),
        "vocab16" => b16,
        "child32" => h.hash_block(Some(&b16), &vocab(32)),
        "mixed20000" => h.hash_block(None, &mixed(20_000, 5)),
        "mixed20000_child" => h.hash_block(Some(&b16), &mixed(20_000, 5)),
        "frame_edge" => {
            let mut tokens = vec![65536; 13_098];
            tokens.extend([1; 4]);
            h.hash_block(None, &tokens)
        }
        "long20000" => h.hash_block(None, &vec![u32::MAX; 20_000]),
        "chain4" => {
            let mut out = Vec::new();
            h.hash_full_blocks(None, &mixed(64, 99), 16, &mut out);
            assert_eq!(out.len(), 4);
            out[3]
        }
        other => panic!("no case {other}"),
    }
}

#[test]
fn every_algorithm_matches_vllm() {
    for golden in &GOLDEN {
        let mut h = BlockHasher::new(golden.algo, &unhex(golden.none_hash)).unwrap();
        for (label, expected) in golden.cases {
            let got = compute(&mut h, label);
            assert_eq!(got.to_string(), expected, "{} {label}", golden.algo.name());
            assert_eq!(got.as_bytes().len(), golden.algo.digest_len());
        }
    }
}

#[test]
fn scratch_reuse_does_not_leak_between_blocks() {
    // A huge block first leaves a long scratch buffer behind; small blocks after it must not
    // see its tail.
    let golden = &GOLDEN[0];
    let mut h = BlockHasher::new(golden.algo, &unhex(golden.none_hash)).unwrap();
    compute(&mut h, "mixed20000");
    assert_eq!(compute(&mut h, "one").to_string(), golden.cases[1].1);
    assert_eq!(compute(&mut h, "empty").to_string(), golden.cases[0].1);
}

#[test]
fn a_parent_changes_the_hash() {
    for golden in &GOLDEN {
        let mut h = BlockHasher::new(golden.algo, &unhex(golden.none_hash)).unwrap();
        let root = h.hash_block(None, &[1, 2, 3, 4]);
        let child = h.hash_block(Some(&root), &[1, 2, 3, 4]);
        assert_ne!(root, child, "{}", golden.algo.name());
        // `None` is the same as passing NONE_HASH explicitly.
        let none = BlockHash::from_bytes(&unhex(golden.none_hash)).unwrap();
        assert_eq!(h.hash_block(Some(&none), &[1, 2, 3, 4]), root);
    }
}

#[test]
fn full_blocks_equal_block_by_block() {
    for golden in &GOLDEN {
        let mut h = BlockHasher::new(golden.algo, &unhex(golden.none_hash)).unwrap();
        let tokens = mixed(16 * 9 + 5, 1);
        let mut all = Vec::new();
        h.hash_full_blocks(None, &tokens, 16, &mut all);
        assert_eq!(all.len(), 9);
        let mut parent = None;
        for (i, block) in tokens.chunks_exact(16).enumerate() {
            let one = h.hash_block(parent.as_ref(), block);
            assert_eq!(all[i], one);
            parent = Some(one);
        }
        // Continuing from a parent appends to `out`.
        let last = all[8];
        h.hash_full_blocks(Some(&last), &tokens[..32], 16, &mut all);
        assert_eq!(all.len(), 11);
        assert_eq!(all[9], h.hash_block(Some(&last), &tokens[..16]));
    }
}

#[test]
fn names_and_lengths() {
    let names: Vec<_> = HashAlgo::ALL.iter().map(|a| a.name()).collect();
    assert_eq!(names, ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]);
    assert_eq!(
        HashAlgo::from_name("xxhash_cbor").unwrap(),
        HashAlgo::XxhashCbor
    );
    assert_eq!(
        HashAlgo::from_name("blake3").unwrap_err(),
        Error::UnsupportedHashAlgo("blake3".into())
    );
    assert!(matches!(
        BlockHasher::new(HashAlgo::Sha256, &[0; 16]),
        Err(Error::InvalidInput(_))
    ));
}
