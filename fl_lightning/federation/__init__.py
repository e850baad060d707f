"""A rank's federation: its inputs assembled from the run's settings (`setup`), the round loop
(`loop`: the one module that knows about ranks and the all-reduce), a round's clients and their
aggregation (`aggregation`), what every rank keeps between rounds (`global_state`, and its
clients' state in bounded memory: `client_store`), how a rank computes its clients (`client_paths`,
`groups`, `trainer`) and the global model's evaluation (`evaluation`). Nothing is imported here:
`setup` is read by the command line, which need not wait for Lightning, which the loop imports."""
