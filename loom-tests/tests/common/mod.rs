//! What the store's model files share (`mod common;` in each).

/// loom's explorer with the preemption bound `LOOM_MAX_PREEMPTIONS` (default 2; 0 is no bound), for
/// models whose threads both run long paths.
pub fn bounded() -> loom::model::Builder {
    let mut b = loom::model::Builder::new();
    let bound = std::env::var("LOOM_MAX_PREEMPTIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    b.preemption_bound = (bound > 0).then_some(bound);
    b
}
