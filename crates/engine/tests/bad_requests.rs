//! Invalid sampling values: the typed error names the field (the unit tests
//! of sampling.rs check the message only).

use qmk_engine::{EngineError, Sampling};

#[test]
fn invalid_sampling_values_are_typed_errors_naming_the_field() {
    let cases = [
        (f32::NAN, 0.9, "temperature"),
        (f32::INFINITY, 0.9, "temperature"),
        (-0.5, 0.9, "temperature"),
        (0.7, 0.0, "top_p"),
        (0.7, 1.5, "top_p"),
        (0.7, f32::NAN, "top_p"),
    ];
    for (temperature, top_p, want) in cases {
        let s = Sampling {
            temperature,
            top_p,
            ..Sampling::greedy()
        };
        let e = s.validate().unwrap_err();
        match &e {
            EngineError::InvalidSampling { field, .. } => assert_eq!(*field, want, "{e}"),
            other => panic!("expected InvalidSampling, got {other:?}"),
        }
        assert!(e.to_string().contains(want), "{e}");
    }
    Sampling::greedy().validate().unwrap();
}
