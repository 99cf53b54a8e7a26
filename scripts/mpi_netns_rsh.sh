#!/bin/sh
# Open MPI's launcher for scripts/mpi_netns.sh (plm_rsh_agent): called as
# "mpi_netns_rsh.sh HOST COMMAND...", runs COMMAND in HOST's namespace
# (10.77.0.(10 + r) is attnns<r>), with a session directory of its own: the
# namespaces share /tmp and the host name.
host=$1
shift
ns=attnns$(echo "$host" | awk -F. '{print $4 - 10}')
mkdir -p "/tmp/attn-netns/$ns"
exec ip netns exec "$ns" env OMPI_MCA_orte_tmpdir_base="/tmp/attn-netns/$ns" PMIX_MCA_gds=hash sh -c "$*"
