"""The write side of the data: `make-shards` (`convert`, `prepare`, `parts`) and `writer`
(`ShardWriter`). It reads sources through `ssl_vit.data.sources`; both sides share the format,
`ssl_vit.data.format`. (Nothing is imported here, so that importing the writer alone, as the
labelled-subset cache does, loads no conversion machinery.)"""
