//! A TCP proxy that makes a good link bad: latency with jitter, a bandwidth
//! limit, stalls (TCP's view of packet loss: nothing arrives for a while,
//! then everything at once) and connections that drop after a random
//! lifetime. Each direction keeps its byte order; impairments apply per
//! chunk of at most one TCP segment.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How bad the link is.
#[derive(Debug, Clone, Default)]
pub struct LinkProfile {
    /// One-way delay added to every chunk.
    pub latency: Duration,
    /// Uniform extra delay, 0..jitter (order is kept).
    pub jitter: Duration,
    /// Bytes per second in each direction; `None`: unlimited.
    pub bandwidth: Option<u64>,
    /// Chance per chunk of a stall.
    pub stall_probability: f64,
    pub stall: Duration,
    /// Mean lifetime of a connection before the proxy cuts it (exponential);
    /// `None`: never.
    pub drop_mean: Option<Duration>,
}

#[derive(Default)]
pub struct ProxyStats {
    bytes: AtomicU64,
    /// Of `bytes`: from the broker to the devices.
    down_bytes: AtomicU64,
    drops: AtomicU64,
}

impl ProxyStats {
    /// Bytes carried, both directions.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Bytes carried from the broker to the devices.
    pub fn down_bytes(&self) -> u64 {
        self.down_bytes.load(Ordering::Relaxed)
    }

    /// Connections cut on purpose.
    pub fn drops(&self) -> usize {
        self.drops.load(Ordering::Relaxed) as usize
    }
}

pub struct Proxy {
    pub addr: SocketAddr,
    pub stats: Arc<ProxyStats>,
    stop: CancellationToken,
}

const SEGMENT: usize = 1460;

impl Proxy {
    /// Listens on 127.0.0.1 (a free port) and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr, profile: LinkProfile, seed: u64) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let stats = Arc::new(ProxyStats::default());
        let stop = CancellationToken::new();
        let (st, sp) = (stats.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n: u64 = 0;
            loop {
                let (down, _) = tokio::select! {
                    _ = sp.cancelled() => return,
                    a = listener.accept() => match a { Ok(a) => a, Err(_) => continue },
                };
                n += 1;
                let (profile, stats, stop) = (profile.clone(), st.clone(), sp.clone());
                tokio::spawn(connection(down, upstream, profile, stats, stop, seed.wrapping_add(n * 104_729)));
            }
        });
        Ok(Proxy { addr, stats, stop })
    }

    pub fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn connection(
    down: TcpStream,
    upstream: SocketAddr,
    profile: LinkProfile,
    stats: Arc<ProxyStats>,
    stop: CancellationToken,
    seed: u64,
) {
    let Ok(up) = TcpStream::connect(upstream).await else { return };
    let _ = down.set_nodelay(true);
    let _ = up.set_nodelay(true);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let lifetime = profile.drop_mean.map(|m| {
        // Exponential: -ln(U) * mean.
        let u: f64 = rng.random_range(f64::EPSILON..1.0);
        m.mul_f64(-u.ln())
    });
    let (dr, dw) = down.into_split();
    let (ur, uw) = up.into_split();
    let mut a = tokio::spawn(direction(dr, uw, profile.clone(), stats.clone(), seed ^ 0x5555, false));
    let mut b = tokio::spawn(direction(ur, dw, profile, stats.clone(), seed ^ 0xaaaa, true));
    let cut = async {
        match lifetime {
            Some(l) => tokio::time::sleep(l).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = cut => { stats.drops.fetch_add(1, Ordering::Relaxed); }
        _ = &mut a => {}
        _ = &mut b => {}
    }
    // Aborting the tasks drops the socket halves: both connections close.
    a.abort();
    b.abort();
}

async fn direction(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    profile: LinkProfile,
    stats: Arc<ProxyStats>,
    seed: u64,
    down: bool,
) {
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(256);
    let reader = async move {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut last = Instant::now();
        let mut buf = vec![0u8; SEGMENT];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let mut delay = profile.latency;
            if !profile.jitter.is_zero() {
                delay += profile.jitter.mul_f64(rng.random_range(0.0..1.0));
            }
            if profile.stall_probability > 0.0 && rng.random_bool(profile.stall_probability.min(1.0)) {
                delay += profile.stall;
            }
            let mut at = (Instant::now() + delay).max(last);
            if let Some(bps) = profile.bandwidth {
                at = at.max(last + Duration::from_secs_f64(n as f64 / bps.max(1) as f64));
            }
            last = at;
            if tx.send((at, buf[..n].to_vec())).await.is_err() {
                return;
            }
        }
    };
    let writer = async move {
        while let Some((at, chunk)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
            stats.bytes.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            if down {
                stats.down_bytes.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}
