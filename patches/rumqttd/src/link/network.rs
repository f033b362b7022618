use bytes::BytesMut;
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    time::timeout,
};

use std::{
    collections::VecDeque,
    io::{self, ErrorKind},
};
use tokio::time::{error::Elapsed, Duration};

use crate::protocol::{self, Packet, Protocol, Verdict};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("I/O = {0}")]
    Io(#[from] io::Error),
    #[error("Invalid data = {0}")]
    Protocol(#[from] protocol::Error),
    #[error["Keep alive timeout"]]
    KeepAlive(#[from] Elapsed),
    /// The codec closed the connection ([`Verdict::Close`]).
    #[error("Closed by the codec")]
    ClosedByCodec,
}

/// What a connection's read buffer starts with (at most): room for a
/// device's CONNECT and the keep-alive pings after it. A larger packet
/// makes the buffer grow to the connection's read buffer size. (edgeway
/// patch, see PATCHES.md)
pub const FIRST_READ_BYTES: usize = 256;

/// Network transforms packets <-> frames efficiently. It takes
/// advantage of pre-allocation, buffering and vectorization when
/// appropriate to achieve performance
pub struct Network<P> {
    /// Socket for IO
    socket: Box<dyn N>,
    /// Buffered reads
    read: BytesMut,
    /// Buffered writes
    write: BytesMut,
    /// Room a full read buffer makes before the next read (at least).
    /// (edgeway patch, see PATCHES.md)
    read_room: usize,
    /// Maximum packet size
    max_incoming_size: usize,
    /// Maximum connection buffer count. TODO: Change this to use bytes for deterministicness
    max_connection_buffer_len: usize,
    /// Keep alive timeout
    keepalive: Duration,
    /// Protocol
    protocol: P,
    /// What the codec answered itself ([`Verdict`]), not written yet.
    answers: VecDeque<Packet>,
    /// The codec closed the connection: nothing more is read.
    closing: bool,
    /// The client's Maximum Packet Size (MQTT 5 CONNECT): a PUBLISH that
    /// would be larger is not written ([`Network::writev`]). (edgeway
    /// patch, see PATCHES.md)
    max_outgoing_size: Option<usize>,
}

impl<P: Protocol> Network<P> {
    pub fn new(
        socket: Box<dyn N>,
        max_incoming_size: usize,
        max_connection_buffer_len: usize,
        protocol: P,
    ) -> Network<P> {
        Self::with_buffers(socket, max_incoming_size, max_connection_buffer_len, protocol, 10 * 1024)
    }

    /// [`Network::new`] whose read buffer makes room for `read_buffer_bytes`
    /// more whenever it is full (it starts with [`FIRST_READ_BYTES`], or
    /// less), and whose write buffer starts empty. Both grow as packets
    /// need and keep what they grew to, so a busy connection reaches its
    /// working size once; an idle one holds a few hundred bytes instead of
    /// two buffers of `read_buffer_bytes`. (edgeway patch, see PATCHES.md)
    pub fn with_buffers(
        socket: Box<dyn N>,
        max_incoming_size: usize,
        max_connection_buffer_len: usize,
        protocol: P,
        read_buffer_bytes: usize,
    ) -> Network<P> {
        let read_room = read_buffer_bytes.max(1);
        Network {
            socket,
            read: BytesMut::with_capacity(read_room.min(FIRST_READ_BYTES)),
            write: BytesMut::new(),
            read_room,
            max_incoming_size,
            max_connection_buffer_len,
            // Overwritten by keepalive value in connect packet, otherwise we
            // would wait indefinitely until we get a packet / network error
            // when we call read.
            keepalive: Duration::MAX,
            protocol,
            answers: VecDeque::new(),
            closing: false,
            max_outgoing_size: None,
        }
    }

    /// See [`Network::writev`]. (edgeway patch, see PATCHES.md)
    pub fn set_max_outgoing_size(&mut self, max: Option<u32>) {
        self.max_outgoing_size = max.map(|m| m as usize);
    }

    pub fn set_keepalive(&mut self, keepalive: u16) {
        let keepalive = Duration::from_secs(keepalive as u64);
        self.keepalive = keepalive + keepalive.mul_f32(0.5);
    }

    /// Reads more than 'required' bytes to frame a packet into self.read buffer
    async fn read_bytes(&mut self, required: usize) -> io::Result<usize> {
        // TODO: Fix this cancellation bug and write unit test
        let mut total_read = 0;
        loop {
            // A full buffer makes room for `read_room` bytes, as one that
            // started that large would (`read_buf` alone makes room for 64
            // bytes at a time). (edgeway patch, see PATCHES.md)
            if self.read.len() == self.read.capacity() {
                self.read.reserve(self.read_room);
            }
            let read = self.socket.read_buf(&mut self.read).await?;
            if 0 == read {
                let error = if self.read.is_empty() {
                    io::Error::new(ErrorKind::ConnectionAborted, "connection closed by peer")
                } else {
                    io::Error::new(ErrorKind::ConnectionReset, "connection reset by peer")
                };

                return Err(error);
            }

            total_read += read;
            if total_read >= required {
                return Ok(total_read);
            }
        }
    }

    /// Waits on network for 1 packet
    pub async fn read(&mut self) -> Result<Packet, Error> {
        loop {
            let required = match Protocol::read_mut(
                &mut self.protocol,
                &mut self.read,
                self.max_incoming_size,
            ) {
                Ok(packet) => return Ok(packet),
                Err(protocol::Error::InsufficientBytes(required)) => required,
                Err(e) => return Err(e.into()),
            };

            // read more packets until a frame can be created. This function
            // blocks until a frame can be created. Use this in a select! branch
            timeout(self.keepalive, self.read_bytes(required)).await??;
        }
    }

    /// [`Network::read`] after CONNECT: the packet goes through the codec's
    /// [`Protocol::screen`]; `None` when the codec answered it itself (see
    /// [`Network::flush_answers`]). (edgeway patch, see PATCHES.md)
    pub async fn read_screened(&mut self) -> Result<Option<Packet>, Error> {
        if self.closing {
            return Err(Error::ClosedByCodec);
        }
        let packet = self.read().await?;
        Ok(self.screen(packet))
    }

    fn screen(&mut self, packet: Packet) -> Option<Packet> {
        match self.protocol.screen(packet) {
            Verdict::Forward(packet) => Some(packet),
            Verdict::Answer(answer) => {
                self.answers.push_back(answer);
                None
            }
            Verdict::Close(last) => {
                self.answers.extend(last);
                self.closing = true;
                None
            }
        }
    }

    /// See [`Protocol::ending`]. (edgeway patch, see PATCHES.md)
    pub fn ending(&self) -> Option<protocol::Ending> {
        self.protocol.ending()
    }

    /// Writes what the codec answered itself; an error once the codec
    /// closed the connection. (edgeway patch, see PATCHES.md)
    pub async fn flush_answers(&mut self) -> Result<(), Error> {
        if !self.answers.is_empty() {
            let answers = std::mem::take(&mut self.answers);
            self.writev(answers).await?;
        }
        match self.closing {
            true => Err(Error::ClosedByCodec),
            false => Ok(()),
        }
    }

    /// After the server ended the connection (the codec's DISCONNECT is
    /// written): shuts the write half (FIN after what was written) and
    /// reads and discards what the client still sends until it closes too
    /// or `within` has passed. Closing a socket with unread input makes
    /// the kernel answer with a reset, which fails the client's writes
    /// and can discard the DISCONNECT it has not read yet. Errors are
    /// ignored: the connection is over either way. (edgeway patch, see
    /// PATCHES.md)
    pub async fn linger(&mut self, within: Duration) {
        let drain = async {
            if self.socket.shutdown().await.is_err() {
                return;
            }
            // Read into the read buffer, emptied each time: a buffer of
            // its own in this future (4 kB) made every connection's task
            // that much larger for its whole life, idle or not. (edgeway
            // patch, see PATCHES.md)
            self.read.clear();
            while let Ok(n) = self.socket.read_buf(&mut self.read).await {
                if n == 0 {
                    return;
                }
                self.read.clear();
            }
        };
        let _ = timeout(within, drain).await;
    }

    /// Read packets in bulk. This allow replies to be in bulk. This method is used
    /// after the connection is established to read a bunch of incoming packets.
    /// Each goes through [`Protocol::screen`] (edgeway patch).
    pub fn readv(&mut self, packets: &mut VecDeque<Packet>) -> Result<usize, Error> {
        loop {
            if self.closing {
                return Ok(packets.len());
            }
            match self
                .protocol
                .read_mut(&mut self.read, self.max_incoming_size)
            {
                Ok(packet) => {
                    let Some(packet) = self.screen(packet) else {
                        continue;
                    };
                    packets.push_back(packet);
                    let connection_buffer_length = packets.len();
                    if connection_buffer_length >= self.max_connection_buffer_len {
                        return Ok(connection_buffer_length);
                    }
                }
                Err(protocol::Error::InsufficientBytes(_)) => return Ok(packets.len()),
                Err(e) => return Err(io::Error::new(ErrorKind::InvalidData, e.to_string()).into()),
            }
        }
    }

    pub async fn write(&mut self, packet: Packet) -> Result<(), Error> {
        Protocol::write(&self.protocol, packet, &mut self.write)?;
        self.socket.write_all(&self.write).await?;
        self.write.clear();
        Ok(())
    }

    pub async fn writev(&mut self, packets: VecDeque<Packet>) -> Result<(), Error> {
        self.writev_bounded(packets).await.map(|_| ())
    }

    /// Whether a Maximum Packet Size applies ([`Network::writev_bounded`]).
    pub fn bounded(&self) -> bool {
        self.max_outgoing_size.is_some()
    }

    /// [`Network::writev`] that leaves out every PUBLISH larger, as
    /// written, than the client's Maximum Packet Size (MQTT-3.1.2-24: the
    /// server must not send it one; MQTT-3.1.2-25: it discards it and
    /// behaves as if it had completed sending it). Returns every PUBLISH,
    /// in order: its QoS, packet id and whether it was left out (for the
    /// link to complete those). (edgeway patch, see PATCHES.md)
    pub async fn writev_bounded(
        &mut self,
        packets: VecDeque<Packet>,
    ) -> Result<Vec<(protocol::QoS, u16, bool)>, Error> {
        let mut publishes = Vec::new();
        for packet in packets {
            let start = self.write.len();
            let publish = match &packet {
                Packet::Publish(p, _) => Some((p.qos, p.pkid)),
                _ => None,
            };
            Protocol::write(&self.protocol, packet, &mut self.write)?;
            if let Some((qos, pkid)) = publish {
                let over = self
                    .max_outgoing_size
                    .is_some_and(|max| self.write.len() - start > max);
                if over {
                    self.write.truncate(start);
                }
                publishes.push((qos, pkid, over));
            }
        }
        if !self.write.is_empty() {
            self.socket.write_all(&self.write).await?;
        }
        self.write.clear();
        Ok(publishes)
    }
}

pub trait N: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T> N for T where T: AsyncRead + AsyncWrite + Unpin + Send {}
