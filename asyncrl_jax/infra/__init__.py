"""Infrastructure every role uses: paths, auth, processes, faults, shardings, shape buckets."""
