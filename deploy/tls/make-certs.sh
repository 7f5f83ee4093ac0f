#!/usr/bin/env bash
# Certificates for mutual TLS between tff-pfl-train (the driver) and its TFF workers'
# nginx fronts (deploy/README.md, "Mutual TLS"). Uses only the openssl command line.
#
#   deploy/tls/make-certs.sh DIR NAMES [NAMES...]
#
# DIR receives (created if needed; an existing DIR/ca.pem and DIR/ca.key are reused, so
# running it again adds workers signed by the same CA):
#   ca.pem, ca.key          the CA. ca.pem goes to the driver (--worker_tls_ca) and to every
#                           worker's front; keep ca.key offline, it signs everything.
#   driver.pem, driver.key  the driver's client certificate and key (--worker_tls_cert,
#                           --worker_tls_key); made once, kept if they exist.
#   <first name>/worker.pem, worker.key, ca.pem
#                           one worker front's server certificate and key, and the CA its
#                           front checks the driver's certificate against: the `tls/`
#                           directory of deploy/tls/nginx-worker.conf.
# NAMES is a worker's comma-separated host names and IP addresses, as the driver dials
# them in --workers (the certificate's subjectAltName), e.g. worker-1.example.org,10.0.0.11
# or localhost,127.0.0.1.
# Keys are EC P-256, unencrypted (gRPC takes no passphrase), readable by their owner only.
# DAYS (environment, default 825) sets the leaf certificates' validity; the CA's is 3650 days.
set -euo pipefail

if [ "$#" -lt 2 ]; then
  echo "usage: $0 DIR NAMES [NAMES...]  (NAMES: a worker's host names and IPs, comma-separated)" >&2
  exit 2
fi
dir="$1"
shift
days="${DAYS:-825}"
mkdir -p "$dir"
umask 077

new_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2> /dev/null; }

# sign KEY CERT SUBJECT EXTENSIONS: a certificate for KEY, signed by the CA.
sign() {
  local key="$1" cert="$2" subject="$3" extensions="$4" csr ext
  csr="$(mktemp)"
  ext="$(mktemp)"
  printf '%b\n' "$extensions" > "$ext"
  openssl req -new -key "$key" -subj "$subject" -out "$csr"
  openssl x509 -req -in "$csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -set_serial "0x$(openssl rand -hex 16)" \
    -days "$days" -sha256 -extfile "$ext" -out "$cert" 2> /dev/null
  rm -f "$csr" "$ext"
  chmod 644 "$cert"
}

if [ ! -f "$dir/ca.pem" ] || [ ! -f "$dir/ca.key" ]; then
  new_key "$dir/ca.key"
  openssl req -new -x509 -key "$dir/ca.key" -subj "/CN=tff-pfl worker CA" -days 3650 -sha256 \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$dir/ca.pem"
  chmod 644 "$dir/ca.pem"
fi

if [ ! -f "$dir/driver.pem" ] || [ ! -f "$dir/driver.key" ]; then
  new_key "$dir/driver.key"
  sign "$dir/driver.key" "$dir/driver.pem" "/CN=tff-pfl-driver" \
    "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth"
fi

for names in "$@"; do
  san=""
  IFS=',' read -r -a parts <<< "$names"
  for name in "${parts[@]}"; do
    if [[ "$name" =~ ^[0-9.]+$ || "$name" == *:* ]]; then entry="IP:$name"; else entry="DNS:$name"; fi
    san="${san:+$san,}$entry"
  done
  worker_dir="$dir/${parts[0]}"
  mkdir -p "$worker_dir"
  new_key "$worker_dir/worker.key"
  sign "$worker_dir/worker.key" "$worker_dir/worker.pem" "/CN=${parts[0]}" \
    "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=$san"
  cp "$dir/ca.pem" "$worker_dir/ca.pem"
  chmod 644 "$worker_dir/ca.pem"
  chmod 755 "$worker_dir"
  echo "$worker_dir: worker.pem (subjectAltName $san), worker.key, ca.pem"
done
echo "$dir: ca.pem, driver.pem, driver.key (driver); ca.key (keep offline)"
