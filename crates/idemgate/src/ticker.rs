//! [`sleep`]: the wait between two renewals of a claim's lease, without a timer of its own.
//!
//! Every claimed request waits for its first lease renewal (10 s with the default lease), and
//! nearly every one finishes long before: the wait is set up and cancelled on every new key. A
//! Tokio timer costs a clock read, a timer-wheel insertion under the driver's lock and a
//! removal under it again (about 700 instructions in all, counted with callgrind). Long waits
//! here share a ticker instead: one task per runtime that ticks every [`TICK`] while anyone on
//! that runtime waits, and wakes each waiter when its tick comes. A wait costs a lock, a waker
//! clone and a slot in a list, and no clock read.
//!
//! A runtime's ticker starts with its first waiter and ends at a tick that finds none; being
//! a task on Tokio's clock, it follows Tokio's paused test clock like any timer, and it runs
//! exactly when the runtime of its waiters runs. A wait polled on another runtime than the
//! one it was listed on (a future moved between runtimes) moves to that runtime's ticker.
//!
//! A long wait ends up to one tick early, never late (but for the ticker's own scheduling),
//! which is what a lease renewal needs: renewing early is harmless. Waits shorter than
//! [`COARSE_MIN`] (leases under 6 s), and waits made outside a runtime, use Tokio's timer.

use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::runtime::{Handle, Id};

use crate::lock::lock;

/// How often a ticker wakes due waiters while anyone waits.
const TICK: Duration = Duration::from_millis(100);
/// The shortest wait given to a ticker: it may end up to one tick early, a twentieth of it.
const COARSE_MIN: Duration = Duration::from_secs(2);

/// The process's tickers and their waiters.
static TICKERS: Tickers = Tickers::new(TICK);

/// A future that is ready once `duration` has passed (up to one [`TICK`] sooner for waits of
/// [`COARSE_MIN`] or longer).
pub(crate) fn sleep(duration: Duration) -> Sleep {
    Sleep::on(&TICKERS, duration)
}

pin_project_lite::pin_project! {
    /// The future of [`sleep`].
    #[project = SleepProj]
    pub(crate) enum Sleep {
        Coarse { #[pin] wait: Wait },
        Precise { #[pin] sleep: tokio::time::Sleep },
    }
}

impl Sleep {
    fn on(tickers: &'static Tickers, duration: Duration) -> Self {
        match (duration >= COARSE_MIN)
            .then(|| Wait::new(tickers, duration))
            .flatten()
        {
            Some(wait) => Sleep::Coarse { wait },
            None => Sleep::Precise {
                sleep: tokio::time::sleep(duration),
            },
        }
    }
}

impl Future for Sleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let left = match self.as_mut().project() {
            SleepProj::Precise { sleep } => return sleep.poll(cx),
            SleepProj::Coarse { wait } => match wait.poll_wait(cx) {
                Waited::Done => return Poll::Ready(()),
                Waited::Pending => return Poll::Pending,
                Waited::NoTicker { left } => left,
            },
        };
        // The runtime's ticker cannot run: Tokio's timer takes the rest of the wait (and, on
        // a runtime without timers, fails in this task as it always did).
        self.set(Sleep::Precise {
            sleep: tokio::time::sleep(left),
        });
        self.poll(cx)
    }
}

/// What a poll of a [`Wait`] found.
enum Waited {
    Done,
    Pending,
    /// Its runtime's ticker failed; `left` of the wait is still to go.
    NoTicker {
        left: Duration,
    },
}

/// Tickers, one per runtime with waiters, and the waiters of all of them.
struct Tickers {
    tick: Duration,
    state: Mutex<State>,
}

// A panic cannot leave the state half-changed: every change under its lock is a few
// infallible vector operations (see `crate::lock`).
struct State {
    clocks: Vec<Clock>,
    /// Waiters in slots reused through a free list, so a wait never moves another.
    slots: Vec<Option<Waiter>>,
    free: Vec<usize>,
}

/// One runtime's ticks.
struct Clock {
    runtime: Id,
    /// Ticks counted so far. It stands still while nobody on the runtime waits, so a wait's
    /// ticks are always ticks of time after it began.
    now: u64,
    /// Waiters listed on this clock.
    waiting: usize,
    /// Whether its ticker task is running.
    ticking: bool,
    /// Whether a ticker task panicked here (a runtime without timers): its waits go to
    /// Tokio's timer instead, and no ticker is started again.
    failed: bool,
}

impl Clock {
    /// Whether nothing uses it: no waiter, no ticker, no failure to remember.
    fn idle(&self) -> bool {
        self.waiting == 0 && !self.ticking && !self.failed
    }
}

struct Waiter {
    runtime: Id,
    /// The tick of its runtime's clock at which it is due.
    due: u64,
    /// Taken when it is woken.
    waker: Option<Waker>,
}

impl State {
    fn clock(&mut self, runtime: Id) -> Option<&mut Clock> {
        self.clocks
            .iter_mut()
            .find(|clock| clock.runtime == runtime)
    }

    /// The runtime's clock, made if it has none.
    fn clock_or_new(&mut self, runtime: Id) -> &mut Clock {
        let at = match self.clocks.iter().position(|c| c.runtime == runtime) {
            Some(at) => at,
            None => {
                self.clocks.push(Clock {
                    runtime,
                    now: 0,
                    waiting: 0,
                    ticking: false,
                    failed: false,
                });
                self.clocks.len() - 1
            }
        };
        &mut self.clocks[at]
    }

    /// Forgets the runtime's clock if nothing uses it any more.
    fn drop_idle_clock(&mut self, runtime: Id) {
        self.clocks.retain(|c| c.runtime != runtime || !c.idle());
    }

    fn insert(&mut self, waiter: Waiter) -> usize {
        match self.free.pop() {
            Some(slot) => {
                self.slots[slot] = Some(waiter);
                slot
            }
            None => {
                self.slots.push(Some(waiter));
                self.slots.len() - 1
            }
        }
    }

    fn remove(&mut self, slot: usize) {
        let Some(Some(waiter)) = self.slots.get_mut(slot).map(Option::take) else {
            return;
        };
        self.free.push(slot);
        let idle = self.clock(waiter.runtime).is_none_or(|clock| {
            clock.waiting -= 1;
            clock.idle()
        });
        if idle {
            self.drop_idle_clock(waiter.runtime);
        }
    }

    /// Takes the wakers of the runtime's waiters that `due` says are due.
    fn take_due(&mut self, runtime: Id, due: impl Fn(u64) -> bool, into: &mut Vec<Waker>) {
        for waiter in self.slots.iter_mut().flatten() {
            if waiter.runtime == runtime
                && due(waiter.due)
                && let Some(waker) = waiter.waker.take()
            {
                into.push(waker);
            }
        }
    }
}

impl Tickers {
    const fn new(tick: Duration) -> Self {
        Self {
            tick,
            state: Mutex::new(State {
                clocks: Vec::new(),
                slots: Vec::new(),
                free: Vec::new(),
            }),
        }
    }

    /// A runtime's ticker task: counts a tick every `tick` and wakes the waiters due by it;
    /// ends at a tick that finds nobody waiting. The guard is made with the future, so a task
    /// dropped before its first poll (its runtime shutting down) still marks the clock stopped.
    fn run(&'static self, runtime: Id) -> impl Future<Output = ()> + Send + 'static {
        let ticking = Ticking {
            tickers: self,
            runtime,
        };
        async move {
            let _ticking = ticking;
            let mut ticks = tokio::time::interval(self.tick);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // The first tick is immediate: the first count comes a whole tick after the start.
            ticks.tick().await;
            let mut due = Vec::new();
            loop {
                ticks.tick().await;
                let mut state = lock(&self.state);
                let Some(clock) = state.clock(runtime).filter(|c| c.waiting > 0) else {
                    return;
                };
                clock.now += 1;
                let now = clock.now;
                state.take_due(runtime, |due| due <= now, &mut due);
                drop(state);
                // Woken outside the lock: a woken task may be polled at once on another thread.
                due.drain(..).for_each(Waker::wake);
            }
        }
    }
}

/// Held by a ticker task. When the task ends, or is dropped with its runtime, its clock is
/// marked stopped and the runtime's waiters left are woken: a waiter polled again starts a
/// ticker on the runtime it is polled on.
struct Ticking {
    tickers: &'static Tickers,
    runtime: Id,
}

impl Drop for Ticking {
    fn drop(&mut self) {
        let mut left = Vec::new();
        let mut state = lock(&self.tickers.state);
        if let Some(clock) = state.clock(self.runtime) {
            clock.ticking = false;
            // Dropped while unwinding: the task panicked, which it only does when it cannot
            // make its timer.
            clock.failed |= std::thread::panicking();
        }
        state.take_due(self.runtime, |_| true, &mut left);
        state.drop_idle_clock(self.runtime);
        drop(state);
        left.into_iter().for_each(Waker::wake);
    }
}

/// A wait on the ticker of the runtime it is polled on: listed at its first poll, delisted
/// when dropped. Made on the runtime of its first poll (as a wait made in an `async` block is).
pub(crate) struct Wait {
    tickers: &'static Tickers,
    /// The runtime it was made on.
    made_on: Id,
    /// Whole ticks to wait, counted from the first poll.
    ticks: u64,
    /// Its slot in the list, once it is listed (the slot holds its runtime and due tick).
    listed: Option<usize>,
}

impl Wait {
    /// A wait of `duration` on the current runtime's ticker; `None` outside a runtime.
    fn new(tickers: &'static Tickers, duration: Duration) -> Option<Self> {
        let made_on = Handle::try_current().ok()?.id();
        let ticks = duration.as_nanos() / tickers.tick.as_nanos().max(1);
        Some(Self {
            tickers,
            made_on,
            ticks: u64::try_from(ticks).unwrap_or(u64::MAX),
            listed: None,
        })
    }

    fn poll_wait(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Waited {
        // The first poll is on the runtime it was made on; a later one looks (a future may be
        // moved to another runtime, or polled outside any: then it ends now rather than never).
        let id = match self.listed {
            None => self.made_on,
            Some(_) => match Handle::try_current() {
                Ok(runtime) => runtime.id(),
                Err(_) => return Waited::Done,
            },
        };
        let tickers = self.tickers;
        let mut state = lock(&tickers.state);
        let found = self.listed.and_then(|slot| {
            let waiter = state.slots.get(slot)?.as_ref()?;
            Some((slot, waiter.runtime, waiter.due))
        });
        let (slot, due) = match found {
            Some((slot, runtime, due)) if runtime == id => (slot, due),
            earlier => {
                // Not listed yet, or listed on another runtime's clock: (re)list here, for
                // the ticks it still has to wait.
                let left = match earlier {
                    Some((slot, runtime, due)) => {
                        let then = state.clock(runtime).map_or(0, |c| c.now);
                        state.remove(slot);
                        due.saturating_sub(then)
                    }
                    None => self.ticks,
                };
                let clock = state.clock_or_new(id);
                let due = clock.now.saturating_add(left);
                clock.waiting += 1;
                let slot = state.insert(Waiter {
                    runtime: id,
                    due,
                    waker: None,
                });
                self.listed = Some(slot);
                (slot, due)
            }
        };
        let Some(clock) = state.clock(id) else {
            return Waited::Done;
        };
        if clock.now >= due {
            return Waited::Done;
        }
        if clock.failed {
            let left = due - clock.now;
            let left = tickers
                .tick
                .saturating_mul(u32::try_from(left).unwrap_or(u32::MAX));
            self.listed = None;
            state.remove(slot);
            return Waited::NoTicker { left };
        }
        // Its runtime has no ticker: one is started there, once the lock is let go (a task
        // refused by a runtime shutting down is dropped at once, and its guard takes the lock).
        let start = if clock.ticking {
            None
        } else {
            let Ok(runtime) = Handle::try_current() else {
                self.listed = None;
                state.remove(slot);
                return Waited::Done;
            };
            clock.ticking = true;
            Some(runtime)
        };
        if let Some(Some(waiter)) = state.slots.get_mut(slot)
            && !waiter
                .waker
                .as_ref()
                .is_some_and(|w| w.will_wake(cx.waker()))
        {
            waiter.waker = Some(cx.waker().clone());
        }
        drop(state);
        if let Some(runtime) = start {
            runtime.spawn(tickers.run(id));
        }
        Waited::Pending
    }
}

impl Drop for Wait {
    fn drop(&mut self) {
        if let Some(slot) = self.listed {
            lock(&self.tickers.state).remove(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    /// In tests a wait is awaited directly: done when its ticks have passed, or when its
    /// ticker fails.
    impl Future for Wait {
        type Output = ();

        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            match self.poll_wait(cx) {
                Waited::Pending => Poll::Pending,
                Waited::Done | Waited::NoTicker { .. } => Poll::Ready(()),
            }
        }
    }

    /// Tickers of their own with a short tick.
    fn tickers(tick: Duration) -> &'static Tickers {
        Box::leak(Box::new(Tickers::new(tick)))
    }

    fn waiting(tickers: &Tickers) -> usize {
        lock(&tickers.state).slots.iter().flatten().count()
    }

    fn clocks(tickers: &Tickers) -> usize {
        lock(&tickers.state).clocks.len()
    }

    fn poll_once<F: Future>(future: Pin<&mut F>) -> Poll<F::Output> {
        future.poll(&mut Context::from_waker(Waker::noop()))
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
    }

    /// A wait made on `runtime`, not yet polled.
    fn made_on(
        runtime: &tokio::runtime::Runtime,
        tickers: &'static Tickers,
        duration: Duration,
    ) -> Pin<Box<Wait>> {
        let _on = runtime.enter();
        Box::pin(Wait::new(tickers, duration).unwrap())
    }

    #[tokio::test]
    async fn a_wait_ends_after_its_ticks_and_leaves_the_list() {
        let tickers = tickers(Duration::from_millis(10));
        let started = Instant::now();
        Wait::new(tickers, Duration::from_millis(200))
            .unwrap()
            .await;
        // Never more than one tick early.
        assert!(started.elapsed() >= Duration::from_millis(190));
        assert_eq!(waiting(tickers), 0);
    }

    #[tokio::test]
    async fn a_dropped_wait_leaves_the_list_and_its_slot_is_reused() {
        let tickers = tickers(Duration::from_millis(10));
        let mut first = Box::pin(Wait::new(tickers, Duration::from_secs(3600)).unwrap());
        assert!(poll_once(first.as_mut()).is_pending());
        assert_eq!(waiting(tickers), 1);
        drop(first);
        assert_eq!(waiting(tickers), 0);
        let mut second = Box::pin(Wait::new(tickers, Duration::from_secs(3600)).unwrap());
        assert!(poll_once(second.as_mut()).is_pending());
        assert_eq!(lock(&tickers.state).slots.len(), 1, "the slot is reused");
    }

    #[tokio::test]
    async fn the_ticker_stops_when_nobody_waits_and_starts_again() {
        let tickers = tickers(Duration::from_millis(5));
        Wait::new(tickers, Duration::from_millis(20)).unwrap().await;
        // The next tick finds nobody: the ticker ends and its clock is forgotten.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(clocks(tickers), 0);
        let started = Instant::now();
        Wait::new(tickers, Duration::from_millis(40)).unwrap().await;
        assert!(started.elapsed() >= Duration::from_millis(35));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_waits_on_several_threads_all_end() {
        let tickers = tickers(Duration::from_millis(5));
        let waits: Vec<_> = (0..50u64)
            .map(|i| tokio::spawn(Wait::new(tickers, Duration::from_millis(10 + i)).unwrap()))
            .collect();
        for wait in waits {
            tokio::time::timeout(Duration::from_secs(10), wait)
                .await
                .expect("every wait ends")
                .unwrap();
        }
        assert_eq!(waiting(tickers), 0);
    }

    #[test]
    fn each_runtime_ticks_for_its_own_waiters() {
        let tickers = tickers(Duration::from_millis(5));
        let (first, second) = (runtime(), runtime());
        // Listed on the first runtime, whose ticker never runs again (it is not driven).
        let mut idle = made_on(&first, tickers, Duration::from_secs(3600));
        first.block_on(async { assert!(poll_once(idle.as_mut()).is_pending()) });
        second.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(10),
                Wait::new(tickers, Duration::from_millis(30)).unwrap(),
            )
            .await
            .expect("the second runtime's ticker runs its wait")
        });
        // Its ticker ends with its runtime, and its clock with it.
        drop(second);
        assert_eq!(clocks(tickers), 1);
        drop(idle);
        assert_eq!((waiting(tickers), clocks(tickers)), (0, 1));
        // The first runtime's ticker task is still there; dropping the runtime ends it.
        drop(first);
        assert_eq!(clocks(tickers), 0);
    }

    /// A wait listed on one runtime whose runtime goes away, polled on another, moves to the
    /// other's ticker with the ticks it had left.
    #[test]
    fn a_wait_moved_to_another_runtime_still_ends() {
        let tickers = tickers(Duration::from_millis(5));
        let (first, second) = (runtime(), runtime());
        let started = Instant::now();
        let mut wait = made_on(&first, tickers, Duration::from_millis(200));
        first.block_on(async {
            assert!(poll_once(wait.as_mut()).is_pending());
            tokio::time::sleep(Duration::from_millis(50)).await;
        });
        drop(first);
        assert!(lock(&tickers.state).clocks.iter().all(|c| !c.ticking));
        second.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), wait.as_mut())
                .await
                .expect("the moved wait ends");
        });
        assert!(started.elapsed() >= Duration::from_millis(190));
        drop(wait);
        assert_eq!(waiting(tickers), 0);
    }

    #[test]
    fn a_wait_polled_outside_a_runtime_ends_rather_than_never() {
        let tickers = tickers(Duration::from_millis(5));
        assert!(
            Wait::new(tickers, Duration::from_secs(1)).is_none(),
            "made outside"
        );
        let mut wait = made_on(&runtime(), tickers, Duration::from_secs(3600));
        assert!(poll_once(wait.as_mut()).is_ready());
        assert_eq!(waiting(tickers), 0);
    }

    /// A runtime that is shut down drops the ticker task it is handed at once: the ticker's
    /// guard then takes the lock, which the wait must have let go.
    #[test]
    fn a_wait_on_a_runtime_shut_down_starts_no_ticker() {
        let tickers = tickers(Duration::from_millis(5));
        let runtime = runtime();
        let handle = runtime.handle().clone();
        let mut wait = made_on(&runtime, tickers, Duration::from_secs(3600));
        runtime.shutdown_background();
        let _on = handle.enter();
        assert!(poll_once(wait.as_mut()).is_pending());
        assert!(lock(&tickers.state).clocks.iter().all(|c| !c.ticking));
    }

    /// On a runtime without timers the ticker task panics as it makes its interval; the wait
    /// then goes to Tokio's timer, which fails in the waiter's own task as a runtime timer
    /// always did there, and no ticker is started again.
    #[test]
    fn on_a_runtime_without_timers_a_wait_fails_in_its_own_task_once() {
        let tickers = tickers(Duration::from_millis(5));
        // On a thread of its own: a ticker started again and again would never let it end.
        let (done, ended) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            let sleep = |duration| {
                let _on = runtime.enter();
                Sleep::Coarse {
                    wait: Wait::new(tickers, duration).unwrap(),
                }
            };
            let waits = [
                sleep(Duration::from_secs(3600)),
                sleep(Duration::from_secs(60)),
            ];
            let failed = waits.map(|wait| {
                let outcome = runtime.block_on(async { tokio::spawn(wait).await });
                outcome.is_err_and(|error| error.is_panic())
            });
            let _ = done.send(failed);
        });
        let failed = ended
            .recv_timeout(Duration::from_secs(30))
            .expect("the waits end rather than start tickers forever");
        assert_eq!(failed, [true, true], "each waiter's own task fails");
        assert!(
            lock(&tickers.state)
                .clocks
                .iter()
                .all(|c| c.failed && !c.ticking)
        );
        assert_eq!(waiting(tickers), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn long_waits_follow_the_paused_clock() {
        let started = tokio::time::Instant::now();
        sleep(Duration::from_secs(10)).await;
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(9_900) && waited <= Duration::from_secs(11));
    }

    #[tokio::test]
    async fn short_waits_use_the_runtime_timer_and_long_ones_the_ticker() {
        assert!(matches!(
            sleep(Duration::from_millis(100)),
            Sleep::Precise { .. }
        ));
        assert!(matches!(sleep(COARSE_MIN), Sleep::Coarse { .. }));
    }
}
