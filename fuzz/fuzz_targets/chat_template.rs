#![no_main]
//! See `qmk_model::fuzzing::chat_template`.
//!
//! `ChatTemplate::render` catches a panic inside minijinja and returns an
//! error (minijinja 2.24's length arithmetic overflows on e.g.
//! `range(10) * 2**62` when overflow checks are on, as here). libfuzzer-sys
//! aborts on every panic, caught or not, so this target lets panics located
//! in minijinja through to that catch; any other panic still aborts.

libfuzzer_sys::fuzz_target!(
    init: {
        let abort = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let in_minijinja = info
                .location()
                .is_some_and(|l| {
                    // The registry crate, or the patched copy (vendor/README.md).
                    l.file().contains("/minijinja-") || l.file().contains("/vendor/minijinja/")
                });
            if !in_minijinja {
                abort(info);
            }
        }));
    },
    |data: &[u8]| qmk_model::fuzzing::chat_template(data)
);
