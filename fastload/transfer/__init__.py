"""Host-to-device transfer: pinned buffers and the copy to the GPU.

`ring` (`BufferRing`: reused, page-locked slots), `pin_stage` (`PinStage`: packing batches
into the ring and releasing slots), `side_stream` (`DeviceStage`: H2D copies on a side
stream with events) and `device_queue` (`DeviceQueue`: the epoch's copies in flight).
"""
