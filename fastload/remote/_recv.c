/* fastload.remote._recv: a socket's bytes received into a buffer in one call, the GIL released.
 *
 *   recv_into(fd, buffer, timeout_s) -> int
 *
 * Receives from socket `fd` into the writable buffer until it is full or the peer ends the stream
 * (recv returns 0); returns the bytes received. Each wait for data (poll) lasts at most `timeout_s`
 * seconds (and at most INT_MAX ms), as each read of a Python socket with a timeout does: TimeoutError
 * past it. The socket may be
 * blocking or not (Python's sockets with a timeout are non-blocking underneath). Errors of recv or poll
 * raise OSError with their errno (ConnectionResetError and the like); an interrupted wait runs Python's
 * signal handlers (KeyboardInterrupt reaches the caller) and goes on.
 *
 * Why: `http.client` reads a body through `socket.SocketIO.readinto`, one Python call for each recv
 * (about 100 KB over loopback), so receiving costs interpreter time per 100 KB on top of the kernel's
 * copy; here the loop over recv runs in C.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>

static PyObject *recv_into(PyObject *self, PyObject *args) {
    int fd;
    PyObject *buffer_obj;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "iOd", &fd, &buffer_obj, &timeout_s)) return NULL;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "recv_into: the socket is closed (negative file descriptor)");
        return NULL;
    }
    if (!(timeout_s > 0)) {
        PyErr_SetString(PyExc_ValueError, "recv_into: the timeout must be positive");
        return NULL;
    }
    Py_buffer buf;
    if (PyObject_GetBuffer(buffer_obj, &buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    char *out = (char *)buf.buf;
    Py_ssize_t size = buf.len, got = 0;
    /* poll's limit, INT_MAX ms (about 24.8 days), bounds the longest wait (an infinite timeout too) */
    const int timeout_ms = timeout_s * 1000.0 >= (double)INT_MAX ? INT_MAX : (int)ceil(timeout_s * 1000.0);
    int err = 0, timed_out = 0;
    for (;;) {
        int interrupted = 0;
        Py_BEGIN_ALLOW_THREADS
        while (got < size) {
            ssize_t n = recv(fd, out + got, (size_t)(size - got), 0);
            if (n > 0) {
                got += n;
                continue;
            }
            if (n == 0) break; /* the peer ended the stream */
            if (errno == EINTR) {
                interrupted = 1;
                break;
            }
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                err = errno;
                break;
            }
            struct pollfd p = {fd, POLLIN, 0};
            int r = poll(&p, 1, timeout_ms);
            if (r == 0) {
                timed_out = 1;
                break;
            }
            if (r < 0) {
                if (errno == EINTR) {
                    interrupted = 1;
                    break;
                }
                err = errno;
                break;
            }
            /* readable, or an error or hang-up that the next recv reports */
        }
        Py_END_ALLOW_THREADS
        if (!interrupted) break;
        if (PyErr_CheckSignals() < 0) {
            PyBuffer_Release(&buf);
            return NULL;
        }
    }
    PyBuffer_Release(&buf);
    if (timed_out) {
        char message[160];
        snprintf(message, sizeof message, "no data for %g s (received %zd of %zd bytes)", timeout_s, got, size);
        PyErr_SetString(PyExc_TimeoutError, message);
        return NULL;
    }
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(got);
}

static PyMethodDef methods[] = {
    {"recv_into", recv_into, METH_VARARGS,
     "recv_into(fd, buffer, timeout_s): receive until the buffer is full or the stream ends, GIL released; "
     "bytes received (TimeoutError when a wait passes timeout_s)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_recv", "Socket receipt in C, GIL released.", -1, methods};

PyMODINIT_FUNC PyInit__recv(void) { return PyModule_Create(&module); }
