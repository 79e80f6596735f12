#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#include <stdlib.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#ifndef MR
#define MR 8
#endif
#ifndef NR
#define NR 3
#endif
__attribute__((noinline)) void tile(int K,const float*A,int lda,const float*B,int ldb,float*C){
  __m512 acc[MR][NR];
  for(int i=0;i<MR;i++)for(int j=0;j<NR;j++)acc[i][j]=_mm512_setzero_ps();
  for(int k=0;k<K;k+=16){__m512 b[NR];for(int j=0;j<NR;j++)b[j]=_mm512_loadu_ps(B+j*ldb+k);
    for(int i=0;i<MR;i++){__m512 a=_mm512_loadu_ps(A+i*lda+k);for(int j=0;j<NR;j++)acc[i][j]=_mm512_fmadd_ps(a,b[j],acc[i][j]);}}
#ifdef NOHSUM
  __m512 s=acc[0][0];for(int i=0;i<MR;i++)for(int j=0;j<NR;j++)s=_mm512_add_ps(s,acc[i][j]);_mm512_storeu_ps(C,s);
#else
  for(int i=0;i<MR;i++)for(int j=0;j<NR;j++)C[i*NR+j]=_mm512_reduce_add_ps(acc[i][j]);
#endif
}
int main(int argc,char**argv){int K=atoi(argv[1]);int M=atoi(argv[2]);
 float*A=aligned_alloc(64,4*M*K),*B=aligned_alloc(64,4*NR*K); static float C[4096]; float s=0;
 for(int i=0;i<M*K;i++)A[i]=1e-3f*i; for(int i=0;i<NR*K;i++)B[i]=1e-3f;
 long it=0;double t0=now(),t;
 do{for(int r=0;r<1000;r++){for(int m=0;m+MR<=M;m+=MR)tile(K,A+m*K,K,B,K,C+m*NR);} it+=1000;t=now()-t0;s+=C[0];}while(t<1.0);
 double fl=2.0*it*(M/MR*MR)*NR*K; printf("MR=%d NR=%d K=%d M=%d: %.1f GFLOP/s %g\n",MR,NR,K,M,fl/t/1e9,s);}
