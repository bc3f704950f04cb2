// Command testpki writes the throw-away key material a loopback kube-apiserver
// needs for a test run, using only the Go standard library:
//
//	ca.crt, ca.key            a self-signed CA (ECDSA P-256)
//	serving.crt, serving.key  the API server's serving certificate, signed by the CA,
//	                          valid for 127.0.0.1, ::1 and localhost
//	sa.key, sa.pub            the service-account token signing key pair
//
// Usage: testpki DIR
package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: testpki DIR")
		os.Exit(2)
	}
	if err := run(os.Args[1]); err != nil {
		fmt.Fprintln(os.Stderr, "testpki:", err)
		os.Exit(1)
	}
}

func run(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	now := time.Now()

	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "gpu-health-conformance-ca"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(7 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return err
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		return err
	}

	srvKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	srvTmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: "kube-apiserver"},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(7 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("::1")},
		DNSNames:     []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"},
	}
	srvDER, err := x509.CreateCertificate(rand.Reader, srvTmpl, caCert, &srvKey.PublicKey, caKey)
	if err != nil {
		return err
	}

	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}

	files := []struct {
		name, typ string
		der       func() ([]byte, error)
	}{
		{"ca.crt", "CERTIFICATE", func() ([]byte, error) { return caDER, nil }},
		{"ca.key", "PRIVATE KEY", func() ([]byte, error) { return x509.MarshalPKCS8PrivateKey(caKey) }},
		{"serving.crt", "CERTIFICATE", func() ([]byte, error) { return srvDER, nil }},
		{"serving.key", "PRIVATE KEY", func() ([]byte, error) { return x509.MarshalPKCS8PrivateKey(srvKey) }},
		{"sa.key", "PRIVATE KEY", func() ([]byte, error) { return x509.MarshalPKCS8PrivateKey(saKey) }},
		{"sa.pub", "PUBLIC KEY", func() ([]byte, error) { return x509.MarshalPKIXPublicKey(&saKey.PublicKey) }},
	}
	for _, f := range files {
		der, err := f.der()
		if err != nil {
			return fmt.Errorf("%s: %w", f.name, err)
		}
		data := pem.EncodeToMemory(&pem.Block{Type: f.typ, Bytes: der})
		if err := os.WriteFile(filepath.Join(dir, f.name), data, 0o600); err != nil {
			return err
		}
	}
	return nil
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		panic(err)
	}
	return n
}
