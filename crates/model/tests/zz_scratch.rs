use qmk_model::chat::*;
use std::collections::BTreeMap;
#[test]
fn scratch() {
    for src in [
        "{{ {'a': [['x'] * 5**12]} }}",
        "{{ ['x'] * 10**12 }}",
        "{{ [['x'] * 10**12] }}",
    ] {
        let t = ChatTemplate::new(src, "t", BTreeMap::new()).unwrap();
        let s = std::time::Instant::now();
        let r = t.render(&[], false);
        println!("{src}: {:?} {:?}", r.map(|s| s.len()), s.elapsed());
    }
}
