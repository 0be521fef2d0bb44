//! Ctrl-C during training: the trainer saves the last completed step and a resumed run ends
//! where an uninterrupted one does. Alone in its binary: the interrupt flag is process-wide.
mod common;
use common::train::*;
use common::*;
use infomem_engine::rl::trainer::latest_checkpoint;
use infomem_engine::util::interrupt;



#[test]
fn ctrl_c_saves_and_resumes_exactly() {
    let (_t, model) = tiny_with_tokenizer("qwen2");
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let mut cfg_b = config(&model, &b, 2);
    cfg_b.save_every = 0; // only the interrupt saves
    let mut tb = trainer(cfg_b.clone(), false, &model);
    let err = tb.run(|m| {
        if m.step == 1 {
            interrupt::set_requested(true); // as the SIGINT handler would
        }
    });
    interrupt::set_requested(false);
    let err = err.unwrap_err();
    assert!(interrupt::is_interrupted(&err), "{err:#}");
    assert!(latest_checkpoint(&b).unwrap().ends_with("step-000001"));
    let mut tb = trainer(cfg_b, true, &model);
    tb.run(|_| {}).unwrap();
    let mut cfg_a = config(&model, &a, 2);
    cfg_a.save_every = 0;
    trainer(cfg_a, false, &model).run(|_| {}).unwrap();
    assert_eq!(adapter_bytes(&a.join("adapter")), adapter_bytes(&b.join("adapter")));
}
