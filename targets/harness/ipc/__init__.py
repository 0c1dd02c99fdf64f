"""The harness's ipc: the wire between the harness and a candidate's processes: frames and typed arrays
over sockets or shared-memory rings, the harness's proxies of the candidate's objects, the weight
export."""
